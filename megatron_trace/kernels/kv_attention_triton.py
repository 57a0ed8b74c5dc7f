"""Triton decode attention over an FP4 KV cache: dequantize K/V tiles in registers, online softmax (split-T).

One query token per sequence, GQA (``G`` query heads share a KV head). Program (batch x KV head, split):
for each tile of ``BT`` cached tokens of its split, ``s = q K^T * scale`` and ``acc += softmax-weights V``
(bf16 MMAs, fp32 accumulation, fp32 online softmax). Each split writes (acc unnormalised, max, sum);
``kv_attention_combine`` merges the splits. Reads 0.5 + 1/16 + 4/head_dim bytes per K/V element instead of 2
(bf16) and never writes the dequantized history. Two paths:

exact (``exact=True``, ``fp4kv_decode_attn_kernel``): K and V rows are decoded from packed codes, block
scales and the per-row global amax with the same fp32 operations as ``dequant_triton`` (``_unscale``, then
one RNE cast to bf16), i.e. the very bf16 values ``FP4Tensor.dequantize(torch.bfloat16)`` gives (an fp32
division per element: slow).

fast (``exact=False``, ``fp4kv_decode_attn_fast_kernel``): the codes are read as uint16 groups of 4 (code
4c+q in nibble q) and dequantized as in ``moe_triton`` (``_dequant``: 13 integer ops + 4 bf16x2 multiplies
per 8 codes, inline PTX on the GPU) into 4 operands ``K'_q[t, c]`` = value * block scale * 2**-62 of element
4c+q, exact in bf16; q is loaded once as the 4 matching strided parts ``q[:, 4c+q]``, so
``q K^T = sum_q q_q K'_q^T * 2**62 / S_enc`` needs no register shuffles. The per-row factor 2**62 / S_enc
(= amax * 2**62 / 2688 for NVFP4 per row or per tensor, 2**62 for MXFP4) multiplies the scores (K, with
``scale``) and the softmax weights before their bf16 cast (V); out[:, 4c+q] accumulates in 4 fp32 parts.
K/V are thus the exact FP4 values (fp32 rounding of 1/S_enc), not their bf16 rounding: the result equals
``reference_attention(kv_dtype=torch.float32)`` within the bf16 rounding of the softmax weights (the softmax
in base 2: log2(e) folded into the K factor, one ``ex2.approx.ftz`` per weight; the max is stored in units of e
for ``combine``). Block scales are read as uint32 words of 4 (uint16 pairs, bytes where the row or alignment does
not allow: ``kv_attention_plan.scale_word``) so that cp.async copies them ahead, and pass an operand-width boundary
(``_operand_width_boundary``) so the MMA operands keep kWidth 2; splits along T fill whole waves of resident
programs (``kv_attention_plan.fast_splits``). Both kernels read the split count from the grid, not a constexpr:
it follows T, and an eager decode's growing cache recompiled the kernel at each new count (62 of the 81 compiles
in the first 1024-token eager generate on an H100, session 49; 4 now). Where
scores are large (|s| >> 1) the bf16 reference's K rounding (2**-9 relative) moves them by more than 1e-2,
so compare against the fp32-K/V reference there. Range: per-row factors overflow fp32 for |K|, |V| amax
above 2**77 (~1.5e23); MXFP4 block exponents must lie in [-63, 63] (``moe_triton``'s 2**64 scale offset;
real K/V after RoPE are O(1..100), far inside).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats.tensor import FP4Tensor
from . import kv_attention_plan as plan
from . import quant_triton as qk
from . import triton_fp4 as f
from .dispatch import cdiv, next_pow2
from .kv_attention import aligned_rows
from .kv_attention_combine import combine_splits
from .kv_attention_loop import (
    _dot,
    _dot_acc,
    _online_softmax,
    _program,
    _query_rows,
    _store_ml,
    _tile_rows,
    _trip_count,
)
from .moe_triton import _dequant, _scale_f32

BLOCK_T = 64
NUM_WARPS = 4
"""Exact path: default tile (cached tokens per step) and warps; sm_90 build without spills: 255 registers at
64/4, 225 at 64/8, 168 at 32/4 (ptxas -v)."""


@triton.jit
def _deq_rows(c_ptr, s_ptr, g_ptr, t, tmask, st_c, st_s, st_g, FMT: tl.constexpr, NB: tl.constexpr,
              B: tl.constexpr, FAST_DIV: tl.constexpr):
    """Rows ``t`` [BT] of one (batch, head): packed codes/scales/amax -> bf16 [BT, NB*B] (the reference's bits)."""
    BT: tl.constexpr = t.shape[0]
    blk = tl.arange(0, NB)[None, :]  # [1, NB]
    off = t[:, None, None] * st_c + blk[:, :, None] * (B // 2) + tl.arange(0, B // 2)[None, None, :]
    p = tl.load(c_ptr + off, mask=tmask[:, None, None], other=0)
    codes = tl.join(p & 15, p >> 4).reshape(BT, NB, B)  # element 2i in the low nibble
    byte = tl.load(s_ptr + t[:, None] * st_s + blk, mask=tmask[:, None], other=0)
    if FMT == f.NVFP4:
        sf = f.e4m3_value(byte)
        e = byte.to(tl.int32)
        s_e = f.nvfp4_encode_scale(tl.load(g_ptr + t * st_g, mask=tmask, other=1.0))[:, None, None]
    else:
        sf = byte.to(tl.float32)
        e = byte.to(tl.int32) - 127
        s_e = 1.0
    out = qk._unscale(codes, sf, e, s_e, FMT, FAST_DIV)
    return f.to_dtype(out.reshape(BT, NB * B), tl.bfloat16)


@triton.jit
def fp4kv_decode_attn_kernel(
    q_ptr, kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, len_ptr, first_ptr, mask_ptr, acc_ptr, ml_ptr,
    T, R, chunk, n_tiles, sm_scale,
    sq_b, sq_h, sm_b,
    skc_b, skc_h, skc_t, sks_b, sks_h, sks_t, skg_b, skg_h, skg_t,
    svc_b, svc_h, svc_t, svs_b, svs_h, svs_t, svg_b, svg_h, svg_t,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, FMT: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
    BT: tl.constexpr, HAS_LEN: tl.constexpr, HAS_FIRST: tl.constexpr,
    LOAD_R: tl.constexpr, HAS_MASK: tl.constexpr, MASK_WORDS: tl.constexpr, FAST_DIV: tl.constexpr,
    F32_DOT: tl.constexpr, TILES: tl.constexpr,
):
    """Exact path: partial attention of split ``program_id(1)`` over the reference's bf16 K/V:
    acc [B, Hq, S, D] (unnormalised), ml [B, Hq, S, 2]."""
    D: tl.constexpr = NB * B
    b, h, split, start, load_end, end, first, n_tiles = _program(len_ptr, first_ptr, T, R, chunk, n_tiles, HKV, BT,
                                                                 HAS_LEN, HAS_FIRST, LOAD_R)
    q, g, gmask, d, m_i, l_i, acc = _query_rows(q_ptr, b, h, sq_b, sq_h, G, GP, D)
    q = q.to(tl.bfloat16)  # [GP, D]
    kc, ks, kg = kc_ptr + b * skc_b + h * skc_h, ks_ptr + b * sks_b + h * sks_h, kg_ptr + b * skg_b + h * skg_h
    vc, vs, vg = vc_ptr + b * svc_b + h * svc_h, vs_ptr + b * svs_b + h * svs_h, vg_ptr + b * svg_b + h * svg_h
    for i in range(0, _trip_count(n_tiles, TILES)):  # chunk / BT; tiles past ``end`` load nothing
        t, tmask, attend = _tile_rows(mask_ptr, b, sm_b, start, load_end, end, first, i, BT, HAS_MASK, MASK_WORDS,
                                      HAS_FIRST, LOAD_R)
        k = _deq_rows(kc, ks, kg, t, tmask, skc_t, sks_t, skg_t, FMT, NB, B, FAST_DIV)  # [BT, D] bf16
        s = _dot(q, tl.trans(k), F32_DOT) * sm_scale  # [GP, BT]
        p, alpha, m_i, l_i = _online_softmax(s, attend, m_i, l_i)
        v = _deq_rows(vc, vs, vg, t, tmask, svc_t, svs_t, svg_t, FMT, NB, B, FAST_DIV)
        acc = acc * alpha[:, None] + _dot(p.to(tl.bfloat16), v, F32_DOT)
    row = (b * (HKV * G) + h * G + g) * tl.num_programs(1) + split  # [GP] into [B, Hq, S]
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
    _store_ml(ml_ptr, row, gmask, m_i, l_i)


@triton.jit
def _cols_mask(tmask, n, N: tl.constexpr):
    """[BT, N] load mask: rows ``tmask``, columns below ``n`` (a [BT, 1] row mask when n == N)."""
    if n == N:
        return tmask[:, None]
    else:
        return tmask[:, None] & (tl.arange(0, N) < n)[None, :]


@triton.jit
def _fp4_groups(c_ptr, s_ptr, t, tmask, st_c, st_s, FMT: tl.constexpr, D: tl.constexpr, DG: tl.constexpr,
                B: tl.constexpr, DEQ_ASM: tl.constexpr, SW: tl.constexpr):
    """Rows t [BT] of uint16 code groups (4 codes each; DG >= D/4 columns, the rest masked) -> 4 bf16 [BT, DG]:
    element 4c + q as value * block scale * 2**-62 (exact: <= 6 significant bits, normal in bf16; 0 if masked)."""
    BT: tl.constexpr = t.shape[0]
    NB: tl.constexpr = DG * 4 // B  # blocks per (padded) row
    u = tl.load(c_ptr + t[:, None] * st_c + tl.arange(0, DG)[None, :], mask=_cols_mask(tmask, D // 4, DG), other=0)
    if SW == 4:  # scale bytes as words of 4 (uint32: cp.async copies them ahead; 2-byte loads it cannot) or 2
        w = tl.load(s_ptr.to(tl.pointer_type(tl.uint32)) + t[:, None] * (st_s // 4) + tl.arange(0, NB // 4)[None, :],
                    mask=_cols_mask(tmask, D // B // 4, NB // 4), other=0)
        s = _scales_bf16((w & 0xFFFF).to(tl.uint16), (w >> 16).to(tl.uint16), FMT, True)
    elif SW == 2:
        w = tl.load(s_ptr.to(tl.pointer_type(tl.uint16)) + t[:, None] * (st_s // 2) + tl.arange(0, NB // 2)[None, :],
                    mask=_cols_mask(tmask, D // B // 2, NB // 2), other=0)
        s = _scales_bf16(w, w, FMT, False)
    else:
        sb = tl.load(s_ptr + t[:, None] * st_s + tl.arange(0, NB)[None, :], mask=_cols_mask(tmask, D // B, NB),
                     other=0)
        s = _scale_f32(sb, FMT).to(tl.bfloat16)  # [BT, NB] block scale * 2**64 (exact)
    s = _operand_width_boundary(s, DEQ_ASM)
    # one scale per code group: group c lies in block c // (B/4) (row-major broadcast + reshape, as moe_triton;
    # a [BT, DG] pointer gather of the scale bytes instead makes Triton pick a 1-element-per-thread layout for the
    # whole dequantization: 1.5x the instructions)
    s = tl.broadcast_to(s[:, :, None], [BT, NB, B // 4]).reshape(BT, DG)
    return _dequant(u, s, DEQ_ASM)


# Two e4m3 block scales (a uint16) -> bf16 scale * 2**64 each: the hardware's exact e4m3x2 -> f16x2, then each
# f16 (normal: e4m3 subnormals are normal in f16) becomes bf16 by its exponent and top 7 mantissa bits moved down
# 3 bits, the exponent rebased (bias 15 -> 127, plus 64): + 176 << 7. Block scales are >= 0 (the sign is dropped).
_E4M3X2_BF16 = tl.constexpr("{ .reg .b32 r; cvt.rn.f16x2.e4m3x2 r, $2; shr.b32 r, r, 3; and.b32 r, r, 0x0FFF0FFF; "
                            "add.u32 r, r, 0x58005800; mov.b32 {$0, $1}, r; }")


@triton.jit
def _pair_bf16(w, FMT: tl.constexpr):
    """uint16 pairs of block scale bytes -> (low, high) bf16 scale * 2**64 (exact)."""
    if FMT == f.NVFP4:
        return tl.inline_asm_elementwise(_E4M3X2_BF16, "=h,=h,h", [w], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=1)
    else:  # E8M0 byte e -> bf16 bits (e + 64) << 7 = 2**(e - 127 + 64)
        x = w.to(tl.int32)
        return (((((x & 0xFF) + 64) << 7).to(tl.uint16)).to(tl.bfloat16, bitcast=True),
                ((((x >> 8) + 64) << 7).to(tl.uint16)).to(tl.bfloat16, bitcast=True))


@triton.jit
def _scales_bf16(w0, w1, FMT: tl.constexpr, QUAD: tl.constexpr):
    """Block scale bytes as uint16 pairs [BT, N] -> bf16 [BT, 2N] (w0: the pairs in order) or, QUAD, [BT, 4N] (w0,
    w1: the low and high halves of words of 4): scale * 2**64, exact (NVFP4 by inline PTX, MXFP4 by integer ops)."""
    BT: tl.constexpr = w0.shape[0]
    N: tl.constexpr = w0.shape[1]
    a, b = _pair_bf16(w0, FMT)
    lo = tl.join(a, b)  # [BT, N, 2]
    if QUAD:
        c, d = _pair_bf16(w1, FMT)
        out = tl.join(lo, tl.join(c, d)).permute(0, 1, 3, 2).reshape(BT, 4 * N)
    else:
        out = lo.reshape(BT, 2 * N)
    return out


@triton.jit
def _operand_width_boundary(x, ASM: tl.constexpr):
    """x itself, on the GPU through a ``mov`` marked as having side effects. Triton sizes the MMA operands' kWidth
    by the narrowest type loaded anywhere upstream of them through pure element-wise ops (``computeOrigBitWidth``
    in its AccelerateMatmul pass); the block scale bytes (8 bits) made it 4, which cost a register copy per
    operand of every MMA. The boundary stops that search at this bf16 value: kWidth 2."""
    if ASM:
        return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [x], dtype=tl.bfloat16, is_pure=False, pack=1)
    else:
        return x


_AMAX_SATURATES = tl.constexpr(7.899322754990586e-36)
"""fp32(2688 / FLT_MAX): below this global amax NVFP4's S_enc saturates at FLT_MAX (``nvfp4.encode_scale``)."""


@triton.jit
def _row_factor(g_ptr, t, tmask, st_g, fac, FMT: tl.constexpr):
    """Per-row fp32 factor [BT]: global amax * fac for NVFP4 (fac = c / 2688: c / S_enc; the amax at least
    2688 / FLT_MAX, where S_enc saturates), fac for MXFP4."""
    if FMT == f.NVFP4:
        g = tl.load(g_ptr + t * st_g, mask=tmask, other=0.0)
        return tl.where(g != g, g, tl.maximum(g, _AMAX_SATURATES)) * fac  # (the GPU's max drops a NaN: kept)
    else:
        return tl.full(t.shape, 1.0, tl.float32) * fac


@triton.jit
def _mma_in(x, F32_DOT: tl.constexpr):
    """An fp32 MMA operand: bf16 on the GPU (RNE), kept in fp32 under the interpreter (fp32 dots)."""
    if F32_DOT:
        return x
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _q_part(q_row, c, mask, Q: tl.constexpr):
    """q[:, 4c + Q] [GP, DG] bf16 by a strided load (the K order of ``_fp4_groups``' operand Q)."""
    return tl.load(q_row + (4 * c + Q)[None, :], mask=mask, other=0.0).to(tl.bfloat16)


@triton.jit
def fp4kv_decode_attn_fast_kernel(
    q_ptr, kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, len_ptr, first_ptr, mask_ptr, acc_ptr, ml_ptr,
    T, R, chunk, n_tiles, k_fac, v_fac,
    sq_b, sq_h, sm_b,
    skc_b, skc_h, skc_t, sks_b, sks_h, sks_t, skg_b, skg_h, skg_t,
    svc_b, svc_h, svc_t, svs_b, svs_h, svs_t, svg_b, svg_h, svg_t,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr, DG: tl.constexpr,
    B: tl.constexpr, BT: tl.constexpr, HAS_LEN: tl.constexpr, HAS_FIRST: tl.constexpr,
    LOAD_R: tl.constexpr, HAS_MASK: tl.constexpr, MASK_WORDS: tl.constexpr,
    F32_DOT: tl.constexpr, DEQ_ASM: tl.constexpr, SW: tl.constexpr, TILES: tl.constexpr,
):
    """Fast path (see the module docstring): like ``fp4kv_decode_attn_kernel`` on K/V operands
    value * block scale * 2**-62 in 4 code-group parts; k_fac / v_fac: per-row factors with 2**62 folded in.
    Codes as uint16 groups (strides in groups); DG >= D/4 group columns (padded to 16 for the MMA's K)."""
    b, h, split, start, load_end, end, first, n_tiles = _program(len_ptr, first_ptr, T, R, chunk, n_tiles, HKV, BT,
                                                                 HAS_LEN, HAS_FIRST, LOAD_R)
    g = tl.arange(0, GP)
    gmask = g < G
    c = tl.arange(0, DG)
    cmask = c < D // 4
    qm = gmask[:, None] & cmask[None, :]
    q_row = q_ptr + b * sq_b + (h * G + g)[:, None] * sq_h
    q0, q1, q2, q3 = _q_part(q_row, c, qm, 0), _q_part(q_row, c, qm, 1), _q_part(q_row, c, qm, 2), \
        _q_part(q_row, c, qm, 3)  # [GP, DG] bf16 each
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([GP, DG], tl.float32)  # out[:, 4c + q] = a_q / l (fp32)
    a1 = tl.zeros([GP, DG], tl.float32)
    a2 = tl.zeros([GP, DG], tl.float32)
    a3 = tl.zeros([GP, DG], tl.float32)
    kc, ks, kg = kc_ptr + b * skc_b + h * skc_h, ks_ptr + b * sks_b + h * sks_h, kg_ptr + b * skg_b + h * skg_h
    vc, vs, vg = vc_ptr + b * svc_b + h * svc_h, vs_ptr + b * svs_b + h * svs_h, vg_ptr + b * svg_b + h * svg_h
    for i in range(0, _trip_count(n_tiles, TILES)):  # chunk / BT; tiles past ``end`` load nothing
        t, tmask, attend = _tile_rows(mask_ptr, b, sm_b, start, load_end, end, first, i, BT, HAS_MASK, MASK_WORDS,
                                      HAS_FIRST, LOAD_R)
        k0, k1, k2, k3 = _fp4_groups(kc, ks, t, tmask, skc_t, sks_t, FMT, D, DG, B, DEQ_ASM, SW)  # [BT, DG]
        s = _dot(q0, tl.trans(k0), F32_DOT)  # [GP, BT] = q K'^T over the 4 parts
        s = _dot_acc(q1, tl.trans(k1), s, F32_DOT)
        s = _dot_acc(q2, tl.trans(k2), s, F32_DOT)
        s = _dot_acc(q3, tl.trans(k3), s, F32_DOT)
        s = s * _row_factor(kg, t, tmask, skg_t, k_fac, FMT)[None, :]  # * 2**62 / S_enc * sm_scale * log2(e)
        p, alpha, m_i, l_i = _online_softmax(s, attend, m_i, l_i, True, DEQ_ASM)
        pv = _mma_in(p * _row_factor(vg, t, tmask, svg_t, v_fac, FMT)[None, :], F32_DOT)  # * 2**62 / S_enc
        v0, v1, v2, v3 = _fp4_groups(vc, vs, t, tmask, svc_t, svs_t, FMT, D, DG, B, DEQ_ASM, SW)
        a0 = _dot_acc(pv, v0, a0 * alpha[:, None], F32_DOT)
        a1 = _dot_acc(pv, v1, a1 * alpha[:, None], F32_DOT)
        a2 = _dot_acc(pv, v2, a2 * alpha[:, None], F32_DOT)
        a3 = _dot_acc(pv, v3, a3 * alpha[:, None], F32_DOT)
    row = (b * (HKV * G) + h * G + g) * tl.num_programs(1) + split  # [GP] into [B, Hq, S]
    out = acc_ptr + row[:, None] * D + 4 * c[None, :]  # acc[.., 4c + q] <- a_q
    tl.store(out, a0, mask=qm)
    tl.store(out + 1, a1, mask=qm)
    tl.store(out + 2, a2, mask=qm)
    tl.store(out + 3, a3, mask=qm)
    _store_ml(ml_ptr, row, gmask, m_i * 0.6931471805599453, l_i)  # the max in units of e (``combine``)


def _parts(t: FP4Tensor):
    """(codes [B,H,T,D/2] uint8, scales [B,H,T,NB] uint8, amax [B,H,T,1] fp32 or a dummy) with their strides."""
    codes, scales = t.codes, t.block_scales.view(torch.uint8)
    if codes.stride(-1) != 1 or scales.stride(-1) != 1:
        codes, scales = codes.contiguous(), scales.contiguous()
    g = t.global_amax
    if g is None:
        g = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=codes.device).expand(*codes.shape[:3], 1)
    elif g.dim() == 0:
        g = g.float().reshape(1, 1, 1, 1).expand(*codes.shape[:3], 1)
    else:
        g = g.float()
    return codes, scales, g


def _groups(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [.., D/2] -> uint16 groups of 4 codes [.., D/4] (code 4c + q in nibble q): a view when the
    storage offset and strides are even (``FP4KVCache`` views are), else a contiguous copy."""
    try:
        return codes.view(torch.uint16)
    except RuntimeError:  # (an odd storage offset stays odd under .contiguous())
        return codes.clone(memory_format=torch.contiguous_format).view(torch.uint16)


def _group_cols(d: int) -> int:
    """Code-group columns of a head_dim-``d`` tile: d/4, at least 16 (an MMA's K; the rest masked)."""
    return max(16, d // 4)


def _row_factors(fmt: str, scale: float) -> tuple[float, float]:
    """(K, V) per-row factors over the global amax: 2**62 / S_enc (* scale for K) = amax * 2**62 / 2688 (NVFP4),
    2**62 (MXFP4)."""
    per_amax = 2.0**62 / 2688.0 if fmt == "nvfp4" else 2.0**62
    return per_amax * scale * math.log2(math.e), per_amax


MXFP4_MIN_BLOCK_T = 32
"""MXFP4 K/V with 16-token tiles where the block scales are read a byte at a time (the exact kernel; the fast one
at one block per row, head_dim 32): wrong outputs on the H200 (right in the interpreter and at the default tiles),
so refused. The fast kernel's uint16/uint32 scale loads (``kv_attention_plan.scale_word`` >= 2)
gave right ones (2026-12-01)."""


def decode_attention(q: torch.Tensor, k: FP4Tensor, v: FP4Tensor, *, scale: float, lengths=None, starts=None,
                     kv_mask=None, readable_rows: int | None = None, exact: bool = True, block_t: int | None = None,
                     splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     max_registers: int | None = None) -> torch.Tensor:
    """q [B, Hq, D], k/v FP4 [B, Hkv, T, D] -> [B, Hq, D] in q.dtype (see the module docstring).

    ``lengths`` int [B]: tokens per sequence; ``starts`` int [B]: each sequence's first attended token (the tiles
    before its tile are not run, the rows before it in its tile weigh 0); ``kv_mask`` bool [B, T]: False = not
    attended (masked rows before the length are still read, so they must hold finite K/V, as the caches' rows do,
    and weigh 0). ``readable_rows`` R >= T: K/V rows [0, R) may be read whatever ``lengths`` says (they must be
    finite, and weigh 0 past the length: e.g. ``FP4KVCache``'s zero-filled spare capacity); the loads then end
    at T rounded up to 16 where R allows (``aligned_rows``), whatever ``lengths`` / ``starts`` say (a bound
    loaded from them would not be known to divide by 16: 521 vs 451 us at b64 / 32K, H200).
    ``exact=True``: K/V are the reference's bf16 values (``FP4Tensor.dequantize(torch.bfloat16)``).
    ``exact=False``: the fast path, K/V the exact FP4 values (equal to ``reference_attention(kv_dtype=float32)``
    within bf16 rounding of the softmax weights). ``block_t``/``num_warps``/``num_stages``/``max_registers`` (per
    thread, the fast path on the GPU; None: the default config's, 0: none): launch overrides."""
    fast = not exact
    d = q.shape[-1]
    if k.fmt == "mxfp4" and block_t is not None and block_t < MXFP4_MIN_BLOCK_T and q.is_cuda and (
            exact or plan.scale_word(True, k.fmt, d, k.block_size, k.block_scales, v.block_scales) == 1):
        raise ValueError(f"block_t={block_t} with MXFP4 K/V is not supported on CUDA for exact={exact}, head_dim {d} "
                         f"(wrong results on the H200, 2026-12-01); use block_t >= {MXFP4_MIN_BLOCK_T} (the defaults "
                         f"do), or the fast path at an even number of blocks per row")
    if fast:
        bt, nw, ns, mr = plan.fast_config(d)
        if max_registers is None and (block_t or bt, num_warps or nw, num_stages or ns) == (bt, nw, ns):
            max_registers = mr  # the default config's cap
        block_t, num_warps, num_stages = block_t or bt, num_warps or nw, num_stages or ns
        max_registers = max_registers or None  # 0: no cap
    else:
        block_t, num_warps = block_t or BLOCK_T, num_warps or NUM_WARPS
    bsz, hq, _ = q.shape
    _, hkv, t_len, _ = k.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    kc, ks, kg = _parts(k)
    vc, vs, vg = _parts(v)
    if fast:
        kc, vc = _groups(kc), _groups(vc)
    group = hq // hkv
    if fast and not splits:
        resident = plan.FAST_RESIDENT.get((plan.config_key(d), block_t, num_warps, num_stages, max_registers), 2)
        splits = plan.fast_splits(bsz * hkv, cdiv(t_len, block_t), plan.sm_count_of(q) * resident)
    splits = splits or plan.exact_splits(q, bsz, hkv, t_len, block_t)
    chunk = cdiv(cdiv(t_len, splits), block_t) * block_t
    acc = torch.empty(bsz, hq, splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bsz, hq, splits, 2, dtype=torch.float32, device=q.device)
    rows = aligned_rows(t_len, readable_rows)
    lens = lengths.to(device=q.device, dtype=torch.int32).contiguous() if lengths is not None else ml
    firsts = starts.to(device=q.device, dtype=torch.int32).contiguous() if starts is not None else ml
    mask, words = plan.mask_arg(kv_mask, t_len, q.device) if kv_mask is not None else (ml, False)
    args = (q, kc, ks, kg, vc, vs, vg, lens, firsts, mask, acc, ml, t_len, rows, chunk, chunk // block_t)
    strides = (q.stride(0), q.stride(1), mask.stride(0), *kc.stride()[:3], *ks.stride()[:3], *kg.stride()[:3],
               *vc.stride()[:3], *vs.stride()[:3], *vg.stride()[:3])
    common = dict(HKV=hkv, G=group, GP=max(16, next_pow2(group)), FMT=0 if k.fmt == "nvfp4" else 1,
                  B=k.block_size, BT=block_t, HAS_LEN=lengths is not None,
                  HAS_FIRST=starts is not None, LOAD_R=readable_rows is not None,
                  HAS_MASK=kv_mask is not None, MASK_WORDS=words,
                  F32_DOT=not q.is_cuda,  # Triton's CPU interpreter: fp32 dots
                  TILES=0 if q.is_cuda else chunk // block_t,
                  num_warps=num_warps)
    if fast:
        fp4kv_decode_attn_fast_kernel[(bsz * hkv, splits)](
            *args, *_row_factors(k.fmt, float(scale)), *strides, D=d, DG=_group_cols(d), DEQ_ASM=q.is_cuda,
            SW=plan.scale_word(q.is_cuda, k.fmt, d, k.block_size, ks, vs),
            num_stages=num_stages, **common, **({"maxnreg": max_registers} if max_registers and q.is_cuda else {}))
    else:
        fp4kv_decode_attn_kernel[(bsz * hkv, splits)](
            *args, float(scale), *strides, NB=ks.shape[-1], FAST_DIV=qk.FAST_DIV, enable_fp_fusion=False, **common)
    return combine_splits(acc, ml, q.dtype)
