"""Triton dequantize (``FP4Tensor.dequantize``) and record compaction (full codes -> mantissa bits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.registry import get_format
from ..formats.tensor import CompactGuidance, FP4Tensor, FullGuidance
from . import quant_pair_triton as qp
from . import quant_triton as qk
from . import triton_fp4 as f
from .quant_triton import GUIDED_FULL, _load_guidance, _unscale


@triton.jit
def dequant_kernel(
    codes_ptr, scales_ptr, g_ptr, out_ptr, M, K, NB, NUM_KT: tl.constexpr,
    FMT: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr, NBT: tl.constexpr,
    FAST_DIV: tl.constexpr, flag_ptr=None, ONLY_FLAGGED: tl.constexpr = False,
):
    """out[M, K] = decode(codes) * scale (``fmt.unscale``), cast once to out's dtype.

    ONLY_FLAGGED: only programs with a row whose flag_ptr[row] != 0 run (``dequant_pair_kernel``'s redo).
    """
    pid = tl.program_id(0)
    if ONLY_FLAGGED:
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        if tl.max(tl.load(flag_ptr + rows, mask=rows < M, other=0), axis=0) != 0:
            _dequant_rows(pid, codes_ptr, scales_ptr, g_ptr, out_ptr, M, K, NB, NUM_KT, FMT, G_MODE, B, BLOCK_M,
                          NBT, FAST_DIV)
    else:
        _dequant_rows(pid, codes_ptr, scales_ptr, g_ptr, out_ptr, M, K, NB, NUM_KT, FMT, G_MODE, B, BLOCK_M, NBT,
                      FAST_DIV)


@triton.jit
def _dequant_rows(pid, codes_ptr, scales_ptr, g_ptr, out_ptr, M, K, NB, NUM_KT: tl.constexpr, FMT: tl.constexpr,
                  G_MODE: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr, NBT: tl.constexpr,
                  FAST_DIV: tl.constexpr):
    """``dequant_kernel``'s work for program ``pid``."""
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    if G_MODE == qk.G_SCALAR:
        s_e = f.nvfp4_encode_scale(tl.load(g_ptr))
    elif G_MODE == qk.G_ROW_GIVEN:
        s_e = f.nvfp4_encode_scale(tl.load(g_ptr + rows, mask=rmask, other=1.0))[:, None, None]
    else:
        s_e = 1.0
    for kt in range(NUM_KT):
        blk = kt * NBT + tl.arange(0, NBT)[None, :]
        bmask = blk < NB
        codes = _load_guidance(codes_ptr, rows, rmask, bmask, blk, NB, NBT, B, GUIDED_FULL)
        byte = tl.load(scales_ptr + rows[:, None] * NB + blk, mask=rmask[:, None] & bmask, other=0)
        if FMT == f.NVFP4:
            sf = f.e4m3_value(byte)
            e = byte.to(tl.int32)
        else:
            sf = byte.to(tl.float32)
            e = byte.to(tl.int32) - 127
        out = _unscale(codes, sf, e, s_e, FMT, FAST_DIV)
        col = kt * NBT * B + tl.arange(0, NBT)[None, :, None] * B + tl.arange(0, B)[None, None, :]
        tl.store(out_ptr + rows[:, None, None] * K + col, f.to_dtype(out, out_ptr.dtype.element_ty),
                 mask=rmask[:, None, None] & (col < K))


@triton.jit
def dequant_pair_kernel(
    codes_ptr, scales_ptr, g_ptr, outw_ptr, flag_ptr, M, NB, NUM_KT: tl.constexpr,
    ODT: tl.constexpr, FMT: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr,
    NBT: tl.constexpr, FAST_DIV: tl.constexpr, HW_CVT: tl.constexpr,
):
    """``dequant_kernel`` for K % B == 0: each code byte becomes one output word (two elements, outw_ptr).

    A program whose rows have an S_enc outside the range where the reciprocal division is exact writes
    nothing and sets flag_ptr[row] = 1 for its rows (else 0) for ``dequant_kernel`` with ONLY_FLAGGED.
    """
    P: tl.constexpr = B // 2
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    if G_MODE == qk.G_SCALAR:
        s_b = f.nvfp4_encode_scale(tl.load(g_ptr) + tl.zeros([BLOCK_M, 1], tl.float32))
    elif G_MODE == qk.G_ROW_GIVEN:
        s_b = f.nvfp4_encode_scale(tl.load(g_ptr + rows, mask=rmask, other=1.0))[:, None]
    else:
        s_b = tl.full([BLOCK_M, 1], 1.0, tl.float32)
    slow = qp._needs_exact(tl.zeros([BLOCK_M, NBT], tl.float32), s_b, G_MODE, 1, True)
    tl.store(flag_ptr + rows, slow + tl.zeros([BLOCK_M], tl.int32), mask=rmask)
    NW = NB * P
    if slow == 0:
        for kt in range(NUM_KT):
            blk = kt * NBT + tl.arange(0, NBT)[None, :]
            bmask = blk < NB
            wcol = kt * (NBT * P) + tl.arange(0, NBT)[None, :, None] * P + tl.arange(0, P)[None, None, :]
            m3 = rmask[:, None, None] & (wcol < NW)
            woff = rows[:, None, None] * NW + wcol
            c = tl.load(codes_ptr + woff, mask=m3, other=0).to(tl.int32)
            byte = tl.load(scales_ptr + rows[:, None] * NB + blk, mask=rmask[:, None] & bmask, other=0)
            cl, ch = c & 15, c >> 4
            if FMT == f.NVFP4:
                sf = f.e4m3_value(byte)[:, :, None]
                vl = f.e2m1_mag(cl & 7) * sf  # exact: <= 2 + 4 significant bits
                vh = f.e2m1_mag(ch & 7) * sf
                s3 = s_b[:, :, None]
                if FAST_DIV:
                    re = tl.div_rn(tl.full(s3.shape, 1.0, tl.float32), s3)
                    vl = f.markstein(vl, -s3, re)
                    vh = f.markstein(vh, -s3, re)
                else:
                    vl, vh = tl.div_rn(vl, s3), tl.div_rn(vh, s3)
            else:
                p2e = f.pow2(byte.to(tl.int32) - 127)[:, :, None]
                vl, vh = f.e2m1_mag(cl & 7) * p2e, f.e2m1_mag(ch & 7) * p2e
            vl = (vl.to(tl.int32, bitcast=True) | ((cl & 8) << 28)).to(tl.float32, bitcast=True)  # code sign
            vh = (vh.to(tl.int32, bitcast=True) | ((ch & 8) << 28)).to(tl.float32, bitcast=True)
            tl.store(outw_ptr + woff, f.pair(vl, vh, ODT, HW_CVT).to(outw_ptr.dtype.element_ty, bitcast=True),
                     mask=m3)


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
    fmt_id, flags = qk.fmt_id(t.fmt), None
    if m and qk.PAIR_KERNEL and k == nb * fmt.block_size:
        odt, wdt = qk._WORD[dtype]
        cfg = qk.CONFIG["dequant"]
        bm, nbt, num_kt = qk.plan(k, fmt.block_size, cfg["tile"])
        flags = torch.empty(m, dtype=torch.int32, device=codes.device)
        dequant_pair_kernel[(triton.cdiv(m, bm),)](
            codes, scales, g, out.view(wdt), flags, m, nb, num_kt, ODT=odt, FMT=fmt_id, G_MODE=int(g_mode),
            B=fmt.block_size, BLOCK_M=bm, NBT=nbt, FAST_DIV=qk.FAST_DIV, HW_CVT=not qk.interpreting(codes),
            num_warps=cfg["num_warps"], enable_fp_fusion=False,
        )
    if m and (flags is None or int(g_mode) != int(qk.G_NONE)):  # MXFP4 pair programs never flag
        cfg = qk.CONFIG["elem"]
        bm, nbt, num_kt = qk.plan(nb * fmt.block_size, fmt.block_size, cfg["tile"])
        dequant_kernel[(triton.cdiv(m, bm),)](
            codes, scales, g, out, m, k, nb, num_kt, FMT=fmt_id, G_MODE=int(g_mode), B=fmt.block_size,
            BLOCK_M=bm, NBT=nbt, FAST_DIV=qk.FAST_DIV if flags is None else False, flag_ptr=flags,
            ONLY_FLAGGED=flags is not None, num_warps=cfg["num_warps"], enable_fp_fusion=False,
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
