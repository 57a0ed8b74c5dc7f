"""Triton dequantize (``FP4Tensor.dequantize``) and record compaction (full codes -> mantissa bits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.registry import get_format
from ..formats.tensor import CompactGuidance, FP4Tensor, FullGuidance
from . import quant_triton as qk
from .quant_triton import GUIDED_FULL, _load_guidance, _unscale


@triton.jit
def dequant_kernel(
    codes_ptr, scales_ptr, g_ptr, out_ptr, M, K, NB, num_kt,
    FMT: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr, NBT: tl.constexpr,
    FAST_DIV: tl.constexpr,
):
    """out[M, K] = decode(codes) * scale (``fmt.unscale``), cast once to out's dtype."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    if G_MODE == qk.G_SCALAR:
        s_e = qk.f.nvfp4_encode_scale(tl.load(g_ptr))
    elif G_MODE == qk.G_ROW_GIVEN:
        s_e = qk.f.nvfp4_encode_scale(tl.load(g_ptr + rows, mask=rmask, other=1.0))[:, None, None]
    else:
        s_e = 1.0
    for kt in range(num_kt):
        blk = kt * NBT + tl.arange(0, NBT)[None, :]
        bmask = blk < NB
        codes = _load_guidance(codes_ptr, rows, rmask, bmask, blk, NB, NBT, B, GUIDED_FULL)
        byte = tl.load(scales_ptr + rows[:, None] * NB + blk, mask=rmask[:, None] & bmask, other=0)
        if FMT == qk.f.NVFP4:
            sf = qk.f.e4m3_value(byte)
            e = byte.to(tl.int32)
        else:
            sf = byte.to(tl.float32)
            e = byte.to(tl.int32) - 127
        out = _unscale(codes, sf, e, s_e, FMT, FAST_DIV)
        col = kt * NBT * B + tl.arange(0, NBT)[None, :, None] * B + tl.arange(0, B)[None, None, :]
        tl.store(out_ptr + rows[:, None, None] * K + col, qk.f.to_dtype(out, out_ptr.dtype.element_ty),
                 mask=rmask[:, None, None] & (col < K))


@triton.jit
def compact_kernel(codes_ptr, bits_ptr, n_out, BLOCK: tl.constexpr):
    """Packed codes (4 bytes = 8 codes) -> one byte of mantissa bits (code 8i+j -> bit j)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    p = tl.load(codes_ptr + offs[:, None] * 4 + tl.arange(0, 4)[None, :], mask=mask[:, None], other=0).to(tl.int32)
    sh = 2 * tl.arange(0, 4)[None, :]
    b = tl.sum(((p & 1) << sh) | (((p >> 4) & 1) << (sh + 1)), axis=1)
    tl.store(bits_ptr + offs, b.to(tl.uint8), mask=mask)


def dequantize(t: FP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t.dequantize(dtype)`` on the GPU."""
    fmt = get_format(t.fmt)
    k = t.shape[-1]
    lead = tuple(t.shape[:-1])
    nb = t.block_scales.shape[-1]
    codes = t.codes.reshape(-1, t.codes.shape[-1]).contiguous()
    scales = t.block_scales.view(torch.uint8).reshape(-1, nb).contiguous()
    m = codes.shape[0]
    out = torch.empty((m, k), dtype=dtype, device=codes.device)
    g_mode, g = qk.G_NONE, scales
    if t.global_amax is not None:
        g = t.global_amax.float().reshape(-1).contiguous()
        g_mode = qk.G_SCALAR if t.global_amax.dim() == 0 else qk.G_ROW_GIVEN
    if m:
        bm, nbt, num_kt = qk.plan(nb * fmt.block_size, fmt.block_size)
        dequant_kernel[(triton.cdiv(m, bm),)](
            codes, scales, g, out, m, k, nb, num_kt, FMT=qk.fmt_id(t.fmt), G_MODE=int(g_mode), B=fmt.block_size,
            BLOCK_M=bm, NBT=nbt, FAST_DIV=qk.FAST_DIV, num_warps=4, enable_fp_fusion=False,
        )
    return out.reshape(*lead, k)


def compact(record: FP4Tensor | FullGuidance) -> CompactGuidance:
    """The compact record (mantissa bits + scales) of a quantized tensor or a full record."""
    codes = record.codes.contiguous()
    bits = torch.empty((*codes.shape[:-1], codes.shape[-1] // 4), dtype=torch.uint8, device=codes.device)
    n = bits.numel()
    if n:
        compact_kernel[(triton.cdiv(n, 1024),)](codes, bits, n, BLOCK=1024, num_warps=4)
    return CompactGuidance(mantissa_bits=bits, block_scales=record.block_scales, global_amax=record.global_amax,
                           shape=record.shape, fmt=record.fmt)
