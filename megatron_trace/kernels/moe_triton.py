"""Triton FP4-weight grouped GEMM (W4A16) for MoE decode on Hopper.

Program (n-tile, expert): for each tile of the expert's tokens, ``acc[n, t] += W'[n, k] @ x^T[k, t]``
with W' dequantized in registers from the packed codes (read as int32 words, 8 codes each) and the
block scales, then ``y[t, n] = acc * 2**62 / S_enc``. Weights are the MMA's M side (swap-AB), so a
decode step with 1..16 tokens per expert still uses a 64-wide MMA and reads each weight byte once.

Dequantization trick: a code ``s e1 e0 m`` placed as bf16 bits ``(code & 7) << 6 | (code & 8) << 12``
is exactly ``value * 2**-126``; two codes (one byte) become one bf16x2 word with a few integer
shifts and masks (``DEQ_ASM``: inline PTX on the bytes; else Triton integer ops on int32 words). The
block scale is pre-multiplied by 2**64 (exact), so ``W' = value * scale * 2**-62`` stays normal.
MXFP4 exponents outside [-63, 63] over/underflow in this path (real weights sit far inside).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.tensor import FP4Tensor
from . import triton_fp4 as f
from .moe import _dense_x, check_grouped_args

# Four code bytes ($4) -> bf16 bits of value * 2**-126: low nibbles ($0, $1) and high nibbles ($2, $3), two
# per register (byte i -> half i). t = bytes (b0, 0, b1, 0): nibble bits land at 0..3 and 16..19 (or 4..7, 20..23).
_DEQ_PTX = tl.constexpr(
    "{ .reg .b32 t0, t1, u, v; "
    "prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342; "
    "shl.b32 u, t0, 6; and.b32 u, u, 0x01C001C0; shl.b32 v, t0, 12; and.b32 v, v, 0x80008000; or.b32 $0, u, v; "
    "shl.b32 u, t1, 6; and.b32 u, u, 0x01C001C0; shl.b32 v, t1, 12; and.b32 v, v, 0x80008000; or.b32 $1, u, v; "
    "shl.b32 u, t0, 2; and.b32 u, u, 0x01C001C0; shl.b32 v, t0, 8; and.b32 v, v, 0x80008000; or.b32 $2, u, v; "
    "shl.b32 u, t1, 2; and.b32 u, u, 0x01C001C0; shl.b32 v, t1, 8; and.b32 v, v, 0x80008000; or.b32 $3, u, v; }"
)
_TWO_POW_64 = tl.constexpr(18446744073709551616.0)
_TWO_POW_62 = tl.constexpr(4611686018427387904.0)


@triton.jit
def _byte_pair_bits(b):
    """int32 byte values (0..255) -> int32 holding the two codes' bf16 bits (value * 2**-126)."""
    u = (b * 0x40040) & 0x01C001C0
    v = (b * 0x1001000) & (0x80008000 - (1 << 32))
    return u | v


@triton.jit
def _dequant_words(r, BN: tl.constexpr, BK: tl.constexpr):
    """int32 words [BN, BK/8] (code 8i+c in nibble c) -> bf16 [BN, BK] = value * 2**-126 (Triton ops)."""
    o0 = _byte_pair_bits(r & 0xFF)
    o1 = _byte_pair_bits((r >> 8) & 0xFF)
    o2 = _byte_pair_bits((r >> 16) & 0xFF)
    o3 = _byte_pair_bits((r >> 24) & 0xFF)
    o = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # [BN, BK/8, j1, j0]: byte j = 2*j1 + j0
    h = tl.join(o.to(tl.uint16), (o >> 16).to(tl.uint16)).reshape(BN, BK)
    return h.to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_bytes(p, BN: tl.constexpr, BK: tl.constexpr):
    """uint8 code bytes [BN, BK/2] -> bf16 [BN, BK] = value * 2**-126 (inline PTX, 4 bytes per call)."""
    lo, hi = tl.inline_asm_elementwise(_DEQ_PTX, "=r,=r,=r,=r,r", [p], dtype=(tl.bfloat16, tl.bfloat16),
                                       is_pure=True, pack=4)
    return tl.join(lo, hi).reshape(BN, BK)


@triton.jit
def _scale_bf16(sc, FMT: tl.constexpr):
    """Block scale bytes -> bf16 scale * 2**64 (exact)."""
    if FMT == f.NVFP4:
        return (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _TWO_POW_64).to(tl.bfloat16)
    else:
        return ((sc.to(tl.int32) + 64) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _column_scale(g):
    """2**62 / S_enc for NVFP4 global amax ``g`` (undoes the 2**64 scale offset and the encode scale)."""
    return tl.div_rn(tl.full(g.shape, 1.0, tl.float32), f.nvfp4_encode_scale(g)) * _TWO_POW_62


@triton.jit
def fp4_gemm_kernel(
    x_ptr, wq_ptr, ws_ptr, g_ptr, y_ptr, offs_ptr,
    N, K, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
    FMT: tl.constexpr, B: tl.constexpr, G_MODE: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, EVEN_K: tl.constexpr, DEQ_ASM: tl.constexpr,
):
    """y[offs[e-1]:offs[e]] = x[...] @ W_e^T for W_e packed FP4 [N, K] (codes as int32 words)."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    end = tl.load(offs_ptr + e).to(tl.int32)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    wrow = wq_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn  # [BN, 1] int32 words or bytes
    srow = ws_ptr + e.to(tl.int64) * stride_se + rn[:, None] * stride_sn
    if G_MODE == 1:
        col = _column_scale(tl.load(g_ptr))
    elif G_MODE == 2:
        col = _column_scale(tl.load(g_ptr + e.to(tl.int64) * N + rn, mask=nmask, other=1.0))[:, None]
    else:
        col = _TWO_POW_62
    for t0 in range(start, end, BT):
        rt = t0 + tl.arange(0, BT)
        tmask = rt < end
        acc = tl.zeros([BN, BT], tl.float32)
        for k in range(0, K, BK):
            if DEQ_ASM:
                kw = k // 2 + tl.arange(0, BK // 2)[None, :]
                kw_end = K // 2
            else:
                kw = k // 8 + tl.arange(0, BK // 8)[None, :]
                kw_end = K // 8
            ks = k // B + tl.arange(0, BK // B)[None, :]
            kx = k + tl.arange(0, BK)[:, None]
            if EVEN_K:
                r = tl.load(wrow + kw, mask=nmask[:, None], other=0)
                sc = tl.load(srow + ks, mask=nmask[:, None], other=0)
                xt = tl.load(x_ptr + rt[None, :] * stride_xt + kx, mask=tmask[None, :], other=0.0)
            else:
                r = tl.load(wrow + kw, mask=nmask[:, None] & (kw < kw_end), other=0)
                sc = tl.load(srow + ks, mask=nmask[:, None] & (ks < K // B), other=0)
                xt = tl.load(x_ptr + rt[None, :] * stride_xt + kx, mask=tmask[None, :] & (kx < K), other=0.0)
            if DEQ_ASM:
                w = _dequant_bytes(r, BN, BK)
            else:
                w = _dequant_words(r, BN, BK)
            w = (w.reshape(BN, BK // B, B) * _scale_bf16(sc, FMT).reshape(BN, BK // B, 1)).reshape(BN, BK)
            acc = tl.dot(w, xt, acc)
        out = acc * col
        tl.store(y_ptr + rt[None, :] * stride_yt + rn[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=tmask[None, :] & nmask[:, None])


# (max average tokens per expert, (BN, BK, BT, num_warps, num_stages), PTX dequant): the first row that fits.
# Picked from the H200 sweep of benchmarks/bench_moe_gemm.py (2026-11-29, BENCHMARKS.md).
CONFIGS = (
    (16, (64, 256, 16, 4, 1), True),
    (64, (64, 128, 64, 4, 3), False),
    (128, (128, 128, 128, 8, 3), False),
    (1 << 30, (128, 64, 256, 8, 3), False),
)
DEQ_ASM_DEFAULT = True
"""Dequantize with inline PTX on the bytes (else Triton integer ops on int32 words) when not given."""


def pick_config(avg_tokens: float, k: int, configs=CONFIGS) -> tuple[tuple[int, int, int, int, int], bool]:
    """((BN, BK, BT, num_warps, num_stages), deq_asm) for ``avg_tokens`` tokens per expert on average."""
    for limit, (bn, bk, bt, nw, ns), asm in configs:
        if avg_tokens <= limit:
            return (bn, min(bk, triton.next_power_of_2(k)), bt, nw, ns), asm
    raise AssertionError("CONFIGS must end with an unbounded row")


def grouped_mm(x, weight: FP4Tensor, offs: torch.Tensor, *, out_dtype: torch.dtype | None = None,
               config: tuple[int, int, int, int, int] | None = None, deq_asm: bool | None = None) -> torch.Tensor:
    """W4A16 grouped GEMM (see the module docstring). ``config``/``deq_asm`` override ``CONFIGS``.

    The config is chosen from the average tokens per expert (x rows / experts), so no host sync is needed.
    """
    if isinstance(x, FP4Tensor):
        from .dequant_triton import dequantize

        x = dequantize(x, torch.bfloat16)  # W4A4 emulation: FP4 activations -> bf16 first
    xd = _dense_x(x)
    e, n, k = check_grouped_args(xd, weight, offs)
    if xd.dtype != torch.bfloat16:
        xd = xd.to(torch.bfloat16)  # the MMA runs bf16 x bf16 -> fp32
    if xd.stride(-1) != 1:
        xd = xd.contiguous()
    out_dtype = out_dtype or xd.dtype
    t = xd.shape[0]
    y = torch.zeros(t, n, dtype=out_dtype, device=xd.device)
    if t == 0:
        return y
    picked, picked_asm = pick_config(t / e, k)
    use_asm = (picked_asm if config is None else DEQ_ASM_DEFAULT) if deq_asm is None else deq_asm
    words = weight.codes.contiguous()  # [E, N, K/2] bytes (PTX path) or int32 words [E, N, K/8]
    words = words if use_asm else words.view(torch.int32)
    scales = weight.block_scales.contiguous().view(torch.uint8)  # [E, N, K/B]
    g = weight.global_amax
    g_mode = 0 if g is None else (1 if g.dim() == 0 else 2)
    g_arg = scales if g is None else g.float().contiguous()
    bn, bk, bt, nw, ns = config or picked
    grid = (triton.cdiv(n, bn), e)
    fp4_gemm_kernel[grid](
        xd, words, scales, g_arg, y, offs,
        n, k, xd.stride(0), words.stride(0), words.stride(1), scales.stride(0), scales.stride(1), y.stride(0),
        FMT=0 if weight.fmt == "nvfp4" else 1, B=weight.block_size, G_MODE=g_mode,
        BN=bn, BK=bk, BT=bt, EVEN_K=k % bk == 0, DEQ_ASM=use_asm,
        num_warps=nw, num_stages=ns,
    )
    return y
