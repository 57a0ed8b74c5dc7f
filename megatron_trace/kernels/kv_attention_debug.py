"""The decode attention kernels' in-register K/V dequantization as standalone launchers, for checking its bits:
``dequantize_rows`` (the exact kernel's, ``_deq_rows``: the reference's bf16 values) and ``dequantize_groups`` (the
fast kernel's operand, ``_fp4_groups``: value x block scale x 2**-62) with its torch twin ``groups_reference``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.tensor import FP4Tensor
from . import kv_attention_plan as plan
from . import quant_triton as qk
from .dispatch import cdiv
from .kv_attention_triton import _deq_rows, _fp4_groups, _group_cols, _groups, _parts


@triton.jit
def deq_rows_kernel(c_ptr, s_ptr, g_ptr, out_ptr, T, st_c, st_s, st_g, FMT: tl.constexpr, NB: tl.constexpr,
                    B: tl.constexpr, BT: tl.constexpr, FAST_DIV: tl.constexpr):
    """out[T, D] = ``_deq_rows`` of rows 0..T-1 (the attention kernel's dequantization, for tests)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    d = tl.arange(0, NB * B)
    x = _deq_rows(c_ptr, s_ptr, g_ptr, t, tmask, st_c, st_s, st_g, FMT, NB, B, FAST_DIV)
    tl.store(out_ptr + t[:, None] * (NB * B) + d[None, :], x, mask=tmask[:, None])


@triton.jit
def deq_groups_kernel(c_ptr, s_ptr, out_ptr, T, st_c, st_s, FMT: tl.constexpr, D: tl.constexpr, DG: tl.constexpr,
                      B: tl.constexpr, BT: tl.constexpr, DEQ_ASM: tl.constexpr, SW: tl.constexpr):
    """out[T, D] bf16 = the fast kernel's K/V operand (``_fp4_groups``) of rows 0..T-1, in element order."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    c = tl.arange(0, DG)
    cmask = c < D // 4
    w0, w1, w2, w3 = _fp4_groups(c_ptr, s_ptr, t, tmask, st_c, st_s, FMT, D, DG, B, DEQ_ASM, SW)
    out = out_ptr + t[:, None] * D + 4 * c[None, :]
    m = tmask[:, None] & cmask[None, :]
    tl.store(out, w0, mask=m)
    tl.store(out + 1, w1, mask=m)
    tl.store(out + 2, w2, mask=m)
    tl.store(out + 3, w3, mask=m)


def _as_2d(t: FP4Tensor) -> FP4Tensor:
    """A [T, D] FP4Tensor as [1, 1, T, D] (for the debug launchers)."""
    g = t.global_amax
    return FP4Tensor(codes=t.codes[None, None], block_scales=t.block_scales[None, None],
                     global_amax=None if g is None else (g if g.dim() == 0 else g[None, None]),
                     shape=(1, 1, *t.shape), fmt=t.fmt)


def dequantize_rows(t: FP4Tensor, block_t: int = 64) -> torch.Tensor:
    """The attention kernel's dequantization of a [T, D] FP4 tensor (bf16), for checking its bits."""
    codes, scales, g = _parts(_as_2d(t))
    n, d = t.shape
    nb = scales.shape[-1]
    out = torch.empty(n, d, dtype=torch.bfloat16, device=codes.device)
    deq_rows_kernel[(cdiv(n, block_t),)](
        codes, scales, g, out, n, codes.stride(2), scales.stride(2), g.stride(2),
        FMT=0 if t.fmt == "nvfp4" else 1, NB=nb, B=t.block_size, BT=block_t, FAST_DIV=qk.FAST_DIV,
        enable_fp_fusion=False,
    )
    return out


def dequantize_groups(t: FP4Tensor, block_t: int = 16, deq_asm: bool | None = None) -> torch.Tensor:
    """The fast path's K/V operand of a [T, D] FP4 tensor: value * block scale * 2**-62 (bf16, exact)."""
    codes, scales, _ = _parts(_as_2d(t))
    words = _groups(codes)
    n, d = t.shape
    out = torch.empty(n, d, dtype=torch.bfloat16, device=codes.device)
    asm = codes.is_cuda if deq_asm is None else deq_asm
    deq_groups_kernel[(cdiv(n, block_t),)](
        words, scales, out, n, words.stride(2), scales.stride(2), FMT=0 if t.fmt == "nvfp4" else 1, D=d,
        DG=_group_cols(d), B=t.block_size, BT=block_t, DEQ_ASM=asm,
        SW=plan.scale_word(asm, t.fmt, d, t.block_size, scales),
    )
    return out


def groups_reference(t: FP4Tensor) -> torch.Tensor:
    """Torch twin of ``dequantize_groups``: decoded code x block scale x 2**-62 in float64, then bf16 (exact)."""
    from ..formats import e2m1

    q = e2m1.decode(t.unpacked_codes(), torch.float64).unflatten(-1, (-1, t.block_size))
    sc = t.block_scales
    sf = sc.double() if t.fmt == "nvfp4" else torch.exp2(sc.view(torch.uint8).double() - 127)
    return (q * sf.unsqueeze(-1) * 2.0**-62).flatten(-2)[..., : t.shape[-1]].to(torch.bfloat16)
