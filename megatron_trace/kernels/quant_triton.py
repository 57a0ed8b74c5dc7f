"""Triton quantize kernel: RNE or guided rounding in one pass, with fused outputs.

One kernel covers every quantize path (the mode and the outputs are compile-time switches):
  MODE 0 (RNE, own scales), 1 (guided full: the record's scales and codes), 2 (guided compact:
  the record's scales and mantissa bits); outputs packed codes, block scales, packed mantissa
  bits (the compact guidance), the dequantized tensor (fake-quant forward) and the STE mask.
Rows are tiles of ``[BLOCK_M, NBT, B]`` (rows x blocks x block elements); a row longer than one
tile loops over K (a per-row amax then takes a first pass over the row).

``quant_pair_triton.pair_kernel`` is the fast path for K % B == 0 (element pairs per word, a per-block
reciprocal with one Markstein correction, RNE / guided indices by integer ops on the fp32 bits); rows outside
the range where that division is exact (tiny/huge amax, Inf) are redone by this module's ``_tile``, in the same
program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fp4 as f
from .dispatch import cdiv, next_pow2, sm_count

# Global amax modes.
G_NONE = tl.constexpr(0)  # MXFP4
G_SCALAR = tl.constexpr(1)  # one fp32 amax (per tensor, computed by absmax_kernel or given)
G_ROW_COMPUTE = tl.constexpr(2)  # per-row amax computed here and written to g_ptr
G_ROW_GIVEN = tl.constexpr(3)  # per-row amax read from g_ptr

# Rounding modes.
RNE = tl.constexpr(0)
GUIDED_FULL = tl.constexpr(1)
GUIDED_COMPACT = tl.constexpr(2)


@triton.jit
def absmax_kernel(x_ptr, n, out_ptr, err_ptr, BLOCK: tl.constexpr, CHECK_FINITE: tl.constexpr,
                  LAST_FIRST: tl.constexpr):
    """Partial max|x| of BLOCK elements per program (fp32), and a count of NaN/Inf if asked. Axis 1 of the grid
    runs over groups of n elements each (``absmax_rows``): group j's partials go to out[j, :].

    ``LAST_FIRST``: program 0 takes the last block (of the last group), so the blocks read last are x's first
    ones, still in L2 when the quantize pass that follows starts at x's beginning (``ABSMAX_LAST_FIRST``). The
    partials land at the same places either way."""
    pid = tl.program_id(0)
    grp = tl.program_id(1).to(tl.int64)
    if LAST_FIRST:
        pid = tl.num_programs(0) - 1 - pid
        grp = tl.num_programs(1) - 1 - grp
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + grp * n + offs, mask=offs < n, other=0.0).to(tl.float32)
    a = tl.abs(x)
    tl.store(out_ptr + grp * tl.num_programs(0) + pid, tl.max(a, axis=0))
    if CHECK_FINITE:
        bad = tl.sum((a == float("inf")).to(tl.int32) + (x != x).to(tl.int32), axis=0)
        if bad > 0:
            tl.atomic_add(err_ptr, bad)


@triton.jit
def group_rows_kernel(parts_ptr, n_parts, rows_per_group, g_ptr, PB: tl.constexpr, RB: tl.constexpr):
    """g[j * rows_per_group + r] = max of parts[j, :] (``absmax_kernel``'s partials of group j) for the RB rows r
    of this program (grid: row chunks x groups)."""
    grp = tl.program_id(1).to(tl.int64)
    m = tl.zeros([PB], tl.float32)
    p0 = 0
    while p0 < n_parts:  # (a while loop: the interpreter's range() takes no run-time bound)
        offs = p0 + tl.arange(0, PB)
        m = tl.maximum(m, tl.load(parts_ptr + grp * n_parts + offs, mask=offs < n_parts, other=0.0))
        p0 += PB
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    tl.store(g_ptr + grp * rows_per_group + r, tl.max(m, axis=0) + tl.zeros([RB], tl.float32), mask=r < rows_per_group)


@triton.jit
def _load_tile(x_ptr, rows, rmask, stride_xm, k0, K, NBT: tl.constexpr, B: tl.constexpr):
    """x[rows, k0 : k0 + NBT*B] as fp32 [BM, NBT, B] (zero beyond K) and its column index."""
    col = k0 + tl.arange(0, NBT)[None, :, None] * B + tl.arange(0, B)[None, None, :]
    mask = rmask[:, None, None] & (col < K)
    x = tl.load(x_ptr + rows[:, None, None] * stride_xm + col, mask=mask, other=0.0).to(tl.float32)
    return x, col


@triton.jit
def _row_amax(x_ptr, rows, rmask, stride_xm, K, NUM_KT: tl.constexpr, NBT: tl.constexpr, B: tl.constexpr):
    """max|x| over each row (fp32 [BM]) by a pass over all K tiles."""
    g = tl.zeros([rows.shape[0]], tl.float32)
    for kt in range(NUM_KT):
        x, _ = _load_tile(x_ptr, rows, rmask, stride_xm, kt * NBT * B, K, NBT, B)
        g = tl.maximum(g, tl.max(tl.max(tl.abs(x), axis=2), axis=1))
    return g


@triton.jit
def _count_bad(x, err_ptr):
    bad = tl.sum(tl.sum(tl.sum((tl.abs(x) == float("inf")).to(tl.int32) + (x != x).to(tl.int32), 2), 1), 0)
    if bad > 0:
        tl.atomic_add(err_ptr, bad)


@triton.jit
def _scales(x, blk, rows, rmask, bmask, s_enc, s_in_ptr, NB, FMT: tl.constexpr, MODE: tl.constexpr):
    """Block scales [BM, NBT]: (NVFP4 value sf as fp32, stored byte, MXFP4 exponent e as int32)."""
    amax_b = tl.max(tl.abs(x), axis=2) if MODE == RNE else tl.zeros([x.shape[0], x.shape[1]], tl.float32)
    return _block_scales(amax_b, blk, rows, rmask, bmask, s_enc, s_in_ptr, NB, FMT, MODE)


@triton.jit
def _block_scales(amax_b, blk, rows, rmask, bmask, s_enc, s_in_ptr, NB, FMT: tl.constexpr, MODE: tl.constexpr):
    """``_scales`` from the block amax [BM, NBT] (used by RNE only)."""
    s_off = rows[:, None] * NB + blk
    if MODE == RNE:
        if FMT == f.NVFP4:
            sf, byte = f.nvfp4_block_scale(amax_b, s_enc)
            e = tl.zeros_like(byte).to(tl.int32)
        else:
            e = f.mx_exponent(amax_b, FMT)
            byte = (e + 127).to(tl.uint8)
            sf = tl.zeros_like(amax_b)
    else:
        byte = tl.load(s_in_ptr + s_off, mask=rmask[:, None] & bmask, other=0)
        if FMT == f.NVFP4:
            sf = f.e4m3_value(byte)
            e = tl.zeros_like(byte).to(tl.int32)
        else:
            e = byte.to(tl.int32) - 127
            sf = tl.zeros_like(amax_b)
    return sf, byte, e


@triton.jit
def _scale_values(x, sf, e, s_enc, FMT: tl.constexpr, FAST_DIV: tl.constexpr):
    """``fmt.scale_values``: z = x * s_enc / sf (0 where sf <= 0) or x * 2**-e."""
    if FMT == f.NVFP4:
        sf3 = sf[:, :, None]
        ok = sf3 > 0.0
        den = tl.where(ok, sf3, 1.0)
        a = x * s_enc
        if FAST_DIV:
            rb = tl.div_rn(tl.full(den.shape, 1.0, tl.float32), den)  # one IEEE division per block
            q = f.div_fast(a, den, rb)
            if tl.max(tl.max(tl.max((f.div_needs_slow(a * rb, den) & ok).to(tl.int32), 2), 1), 0) > 0:
                q = tl.div_rn(a, den)
        else:
            q = tl.div_rn(a, den)
        return tl.where(ok, q, 0.0)
    else:
        return x * f.pow2(-e)[:, :, None]


@triton.jit
def _unscale(codes, sf, e, s_enc, FMT: tl.constexpr, FAST_DIV: tl.constexpr):
    """``fmt.unscale`` of decoded codes: q * sf / s_enc or q * 2**e (fp32)."""
    q = f.e2m1_decode(codes)
    if FMT == f.NVFP4:
        a = q * sf[:, :, None]
        if FAST_DIV:
            rb = tl.div_rn(1.0 + tl.zeros_like(s_enc), s_enc)  # per tensor or per row
            out = f.div_fast(a, s_enc, rb)
            if tl.max(tl.max(tl.max(f.div_needs_slow(a * rb, s_enc).to(tl.int32), 2), 1), 0) > 0:
                out = tl.div_rn(a, s_enc)
        else:
            out = tl.div_rn(a, s_enc)
        return out
    else:
        return q * f.pow2(e)[:, :, None]


@triton.jit
def _load_guidance(gc_ptr, rows, rmask, bmask, blk, NB, NBT: tl.constexpr, B: tl.constexpr, MODE: tl.constexpr):
    """The record's codes (MODE 1, unpacked uint8) or mantissa bits (MODE 2, 0/1) as [BM, NBT, B]."""
    m3 = rmask[:, None, None] & bmask[:, :, None]
    if MODE == GUIDED_FULL:
        off = rows[:, None, None] * (NB * B // 2) + blk[:, :, None] * (B // 2) + tl.arange(0, B // 2)[None, None, :]
        p = tl.load(gc_ptr + off, mask=m3, other=0)
        return tl.join(p & 15, p >> 4).reshape(rows.shape[0], NBT, B)
    else:
        off = rows[:, None, None] * (NB * B // 8) + blk[:, :, None] * (B // 8) + tl.arange(0, B // 8)[None, None, :]
        p = tl.load(gc_ptr + off, mask=m3, other=0)
        bits = (p[:, :, :, None] >> tl.arange(0, 8)[None, None, None, :].to(tl.uint8)) & 1
        return bits.reshape(rows.shape[0], NBT, B)


@triton.jit
def _store_codes(codes, codes_ptr, bits_ptr, rows, rmask, bmask, blk, NB, NBT: tl.constexpr, B: tl.constexpr,
                 WRITE_CODES: tl.constexpr, WRITE_BITS: tl.constexpr):
    m3 = rmask[:, None, None] & bmask[:, :, None]
    BM: tl.constexpr = codes.shape[0]
    if WRITE_CODES:
        lo, hi = tl.split(codes.reshape(BM, NBT, B // 2, 2))
        off = rows[:, None, None] * (NB * B // 2) + blk[:, :, None] * (B // 2) + tl.arange(0, B // 2)[None, None, :]
        tl.store(codes_ptr + off, lo | (hi << 4), mask=m3)
    if WRITE_BITS:
        w = (1 << tl.arange(0, 8)).to(tl.int32)
        b = tl.sum((codes & 1).to(tl.int32).reshape(BM, NBT, B // 8, 8) * w[None, None, None, :], axis=3)
        off = rows[:, None, None] * (NB * B // 8) + blk[:, :, None] * (B // 8) + tl.arange(0, B // 8)[None, None, :]
        tl.store(bits_ptr + off, b.to(tl.uint8), mask=m3)


@triton.jit
def _tile(x, col, kt, rows, rmask, K, NB, s_b, s_e, s_in_ptr, gc_ptr, codes_ptr, scales_ptr, bits_ptr, deq_ptr,
          mask_ptr, err_ptr, FMT: tl.constexpr, MODE: tl.constexpr, B: tl.constexpr, NBT: tl.constexpr,
          WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr, WRITE_BITS: tl.constexpr,
          WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, CHECK_FINITE: tl.constexpr, FAST_DIV: tl.constexpr,
          KEEP_NONFINITE: tl.constexpr):
    """Quantize one [BM, NBT, B] tile of x (fp32) and write the asked outputs (KEEP_NONFINITE: NaN/Inf
    elements of x are written to the dequantized output as they are, not as codes)."""
    if CHECK_FINITE:
        _count_bad(x, err_ptr)
    blk = kt * NBT + tl.arange(0, NBT)[None, :]  # [1, NBT]
    bmask = blk < NB
    sf, byte, e = _scales(x, blk, rows, rmask, bmask, s_b, s_in_ptr, NB, FMT, MODE)
    z = _scale_values(x, sf, e, s_e, FMT, FAST_DIV)
    if MODE == RNE:
        codes = f.e2m1_rne(z)
    elif MODE == GUIDED_FULL:
        codes = f.guided_full(z, _load_guidance(gc_ptr, rows, rmask, bmask, blk, NB, NBT, B, MODE))
    else:
        codes = f.guided_compact(z, _load_guidance(gc_ptr, rows, rmask, bmask, blk, NB, NBT, B, MODE))
    _store_codes(codes, codes_ptr, bits_ptr, rows, rmask, bmask, blk, NB, NBT, B, WRITE_CODES, WRITE_BITS)
    if WRITE_SCALES:
        tl.store(scales_ptr + rows[:, None] * NB + blk, byte, mask=rmask[:, None] & bmask)
    emask = rmask[:, None, None] & (col < K)
    if WRITE_DEQ:
        out = _unscale(codes, sf, e, s_e, FMT, FAST_DIV)
        if KEEP_NONFINITE:
            out = tl.where((x == x) & (tl.abs(x) != float("inf")), out, x)
        tl.store(deq_ptr + rows[:, None, None] * K + col, f.to_dtype(out, deq_ptr.dtype.element_ty), mask=emask)
    if WRITE_MASK:
        tl.store(mask_ptr + rows[:, None, None] * K + col, (tl.abs(z) <= 6.0).to(tl.uint8), mask=emask)


@triton.jit
def quant_kernel(
    x_ptr, M, K, stride_xm, NB, NUM_KT: tl.constexpr,
    g_ptr, s_in_ptr, gc_ptr,
    codes_ptr, scales_ptr, bits_ptr, deq_ptr, mask_ptr, err_ptr,
    FMT: tl.constexpr, MODE: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr,
    BLOCK_M: tl.constexpr, NBT: tl.constexpr, SINGLE_TILE: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr, WRITE_BITS: tl.constexpr,
    WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, CHECK_FINITE: tl.constexpr, FAST_DIV: tl.constexpr,
    KEEP_NONFINITE: tl.constexpr = False,
):
    """Quantize rows of x [M, K] (fp32/bf16/fp16) block by block; see the module docstring.

    KEEP_NONFINITE: NaN/Inf inputs pass to the dequantized output unchanged (a checked call's inputs).
    """
    _quant_rows(tl.program_id(0), x_ptr, M, K, stride_xm, NB, NUM_KT, g_ptr, s_in_ptr, gc_ptr, codes_ptr,
                scales_ptr, bits_ptr, deq_ptr, mask_ptr, err_ptr, FMT, MODE, G_MODE, B, BLOCK_M, NBT, SINGLE_TILE,
                WRITE_CODES, WRITE_SCALES, WRITE_BITS, WRITE_DEQ, WRITE_MASK, CHECK_FINITE, FAST_DIV,
                KEEP_NONFINITE)


@triton.jit
def _quant_rows(
    pid, x_ptr, M, K, stride_xm, NB, NUM_KT: tl.constexpr, g_ptr, s_in_ptr, gc_ptr,
    codes_ptr, scales_ptr, bits_ptr, deq_ptr, mask_ptr, err_ptr,
    FMT: tl.constexpr, MODE: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr,
    BLOCK_M: tl.constexpr, NBT: tl.constexpr, SINGLE_TILE: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr, WRITE_BITS: tl.constexpr,
    WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, CHECK_FINITE: tl.constexpr, FAST_DIV: tl.constexpr,
    KEEP_NONFINITE: tl.constexpr,
):
    """``quant_kernel``'s work for program ``pid``."""
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    if SINGLE_TILE:
        x0, col0 = _load_tile(x_ptr, rows, rmask, stride_xm, 0, K, NBT, B)
    if G_MODE == G_SCALAR:
        s_b = f.nvfp4_encode_scale(tl.load(g_ptr))  # scalar S_enc
        s_e = s_b
    elif G_MODE == G_NONE:
        s_b = 1.0
        s_e = 1.0
    else:
        if G_MODE == G_ROW_COMPUTE:
            if SINGLE_TILE:
                g1 = tl.max(tl.max(tl.abs(x0), axis=2), axis=1)
            else:
                g1 = _row_amax(x_ptr, rows, rmask, stride_xm, K, NUM_KT, NBT, B)
            tl.store(g_ptr + rows, g1, mask=rmask)
        else:
            g1 = tl.load(g_ptr + rows, mask=rmask, other=1.0)
        s1 = f.nvfp4_encode_scale(g1)  # [BM]
        s_b = s1[:, None]
        s_e = s1[:, None, None]
    if SINGLE_TILE:
        _tile(x0, col0, 0, rows, rmask, K, NB, s_b, s_e, s_in_ptr, gc_ptr, codes_ptr, scales_ptr, bits_ptr,
              deq_ptr, mask_ptr, err_ptr, FMT, MODE, B, NBT, WRITE_CODES, WRITE_SCALES, WRITE_BITS, WRITE_DEQ,
              WRITE_MASK, CHECK_FINITE, FAST_DIV, KEEP_NONFINITE)
    else:
        for kt in range(NUM_KT):
            x, col = _load_tile(x_ptr, rows, rmask, stride_xm, kt * NBT * B, K, NBT, B)
            _tile(x, col, kt, rows, rmask, K, NB, s_b, s_e, s_in_ptr, gc_ptr, codes_ptr, scales_ptr, bits_ptr,
                  deq_ptr, mask_ptr, err_ptr, FMT, MODE, B, NBT, WRITE_CODES, WRITE_SCALES, WRITE_BITS,
                  WRITE_DEQ, WRITE_MASK, CHECK_FINITE, FAST_DIV, KEEP_NONFINITE)


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------

TILE = 4096
"""Elements of x per program tile (rows x padded K); longer rows loop over K in tiles of this size."""

ABSMAX_BLOCK = 8192
ABSMAX_WARPS = 8
"""The amax pass: elements per program, and its warps (``bench_amax_pass.py --sweep`` times the choices)."""
ABSMAX_PARTS = 1024
"""``absmax_rows``: partial maxima per step of its second kernel's loop."""
ABSMAX_LAST_FIRST = True
"""The amax pass of a two-pass quantize reads x from its end back to its start, so that the quantize pass, which
reads it from the start, finds the blocks read last in L2 (1.8-3.2% less device time for the pair on an H100,
session 46; False: the order before it, which ``bench_quant.py``'s "amax first-first" arm times)."""

FAST_DIV = True
"""Divide by the per-block scale with a reciprocal + one Markstein step (IEEE division only on rare tiles)."""

CONFIG = {"pair": {"tile": 2048, "num_warps": 1}, "pair_guided": {"tile": 2048, "num_warps": 4},
          "pair_fake": {"tile": 2048, "num_warps": 2}, "pair_mxfp4": {"tile": 4096, "num_warps": 2},
          "elem": {"tile": TILE, "num_warps": 4}, "dequant": {"tile": 16384, "num_warps": 8},
          "dequant_mxfp4": {"tile": 16384, "num_warps": 8}}
"""Launch configs (elements per program tile, warps) of ``pair_kernel`` (NVFP4; NVFP4 guided compact rounding;
NVFP4 RNE fake-quant; MXFP4: ``pair_launch.config_name``), ``quant_kernel`` and ``dequant_pair_kernel``
(NVFP4; MXFP4; a bf16 output). Optional keys (GPU only): "max_registers", a register cap (``register_cap``;
session 16 measured no gain for guided compact or dequantize, BENCHMARKS.md); "programs_per_sm" (``pair_kernel``
with one tile per row group): that many programs per multiprocessor at most, each looping over row groups and
issuing the next group's loads before rounding the current one (``PREFETCH``). Sessions 17-18 measured the
choices (BENCHMARKS.md): the prefetching grid took guided compact + dequant from 92.3 to 87.4-88.3 us in session 17,
but with session 18's shorter tile (40 registers instead of 92) the plain grid is faster (84.7 against 90.6 us), so
no config uses it; 2 warps take RNE fake-quant from 89.6 to 83.9 us and, with session 18's code words (whole blocks
per thread), quantize + record from 64.6 to 61.0 us. In session 19 (40 registers), 1 warp took quantize + record
from 53.8 to 52.9 us (4 warps: 61.5) and 2 warps MXFP4 quantize from 58.6 to 54.1-54.5 (8 warps: 67.5; 8192
elements: 55.0 at 4 warps, 62.2 at 2); "pair_guided" also serves guided full rounding (2 warps: 111.2 against
110.1 us). ``benchmarks/bench_quant.py --sweep`` times the alternatives (session 10: 2048 elements is 9% faster
than 4096 for guided compact + dequant, 10% slower for MXFP4 quantize)."""

PAIR_KERNEL = True
"""Use ``pair_kernel`` / ``dequant_pair_kernel`` where they apply (K % block == 0, aligned rows).
Off: the element-wise kernels everywhere (``bench_quant.py --sweep --elem`` compares the two)."""

GUIDED_BY_MAGNITUDE = True
"""Guided NVFP4 rounding (compact and full) of bf16/fp32 rows in ``pair_kernel`` by fp32 magnitudes
(``quant_guided_triton``; off: the E2M1-index tile, ``bench_quant.py`` times both)."""

RNE_BY_MAGNITUDE = True
"""RNE NVFP4 rounding of bf16/fp32 rows in ``pair_kernel`` by fp32 magnitudes (``quant_rne_triton``; off: the
E2M1-index tile, ``bench_quant.py`` times both)."""

DEQUANT_BY_MAGNITUDE = True
"""Dequantize to bf16 in ``dequant_pair_kernel`` by two constants per block (``dequant_triton._tile_by_consts``:
on the GPU a per-block table of the 8 magnitudes and byte permutes, NVFP4 and MXFP4; NVFP4 in the interpreter by
bits); off, and for fp16/fp32 out: decode, multiply (and divide) per element. ``bench_quant.py`` times both."""

_WORD = {torch.bfloat16: (0, torch.int32), torch.float16: (1, torch.int32), torch.float32: (2, torch.int64)}


def fmt_id(fmt: str, scale_rule: str = "floor") -> int:
    """The kernel's format selector for ``fmt`` (and the MXFP4 scale rule)."""
    if fmt == "nvfp4":
        return 0
    return {"floor": 1, "ceil": 2}[scale_rule]


def plan(kp: int, block: int, tile: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, NBT, num_kt) for padded row length ``kp``: one tile per row group or a loop over K."""
    tile = tile or TILE
    bk = next_pow2(kp)
    if bk <= tile:
        return max(1, tile // bk), bk // block, 1
    return 1, tile // block, cdiv(kp, tile)


def pair_ok(x2d, block, deq_dtype) -> bool:
    """Whether ``pair_kernel`` applies: whole blocks per row, rows that can be read as element pairs."""
    k = x2d.shape[1]
    return (PAIR_KERNEL and k % block == 0 and x2d.dtype in _WORD
            and deq_dtype in (None, x2d.dtype) and x2d.stride(0) % 2 == 0
            and x2d.data_ptr() % (2 * x2d.element_size()) == 0)


def absmax(x2d: torch.Tensor, err: torch.Tensor | None) -> torch.Tensor:
    """max|x| over the whole tensor as a 0-d fp32 tensor (a partial max per program, then torch.amax)."""
    x2d = x2d if x2d.is_contiguous() else x2d.contiguous()  # the kernel reads numel() elements from data_ptr
    n = x2d.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x2d.device)  # as the reference: no element, amax 0
    parts = torch.empty(cdiv(n, ABSMAX_BLOCK), dtype=torch.float32, device=x2d.device)
    dummy = err if err is not None else parts
    absmax_kernel[(parts.numel(),)](x2d, n, parts, dummy, BLOCK=ABSMAX_BLOCK, CHECK_FINITE=err is not None,
                                    LAST_FIRST=ABSMAX_LAST_FIRST, num_warps=ABSMAX_WARPS)
    return parts.amax()


def absmax_rows(x2d: torch.Tensor, groups: int, err: torch.Tensor | None) -> torch.Tensor:
    """Per row of x2d [M, K], the max|x| (fp32 [M]) of its group: the rows are ``groups`` equal groups of
    consecutive rows (e.g. stacked expert weights [E, N, K] as [E * N, K]). Two launches: partial maxima, then
    each group's maximum written to its rows. NaN/Inf are counted into ``err`` if given."""
    m = x2d.shape[0]
    if groups < 1 or m % groups:
        raise ValueError(f"groups={groups} must be >= 1 and divide the {m} rows")
    xc = x2d if x2d.is_contiguous() else x2d.contiguous()
    n = (m // groups) * x2d.shape[1]
    n_parts = max(cdiv(n, ABSMAX_BLOCK), 1)
    parts = torch.empty((groups, n_parts), dtype=torch.float32, device=x2d.device)
    g = torch.empty(m, dtype=torch.float32, device=x2d.device)
    if m == 0:
        return g
    absmax_kernel[(n_parts, groups)](xc, n, parts, err if err is not None else parts, BLOCK=ABSMAX_BLOCK,
                                     CHECK_FINITE=err is not None, LAST_FIRST=ABSMAX_LAST_FIRST, num_warps=ABSMAX_WARPS)
    rb, pb = 256, min(next_pow2(n_parts), ABSMAX_PARTS)
    group_rows_kernel[(cdiv(m // groups, rb), groups)](parts, n_parts, m // groups, g, PB=pb, RB=rb)
    return g


def run_quant(
    x2d: torch.Tensor, *, fmt: int, block: int, mode: int, g_mode: int, g: torch.Tensor | None = None,
    scales_in: torch.Tensor | None = None, guide: torch.Tensor | None = None, write_codes: bool = True,
    write_scales: bool = True, write_bits: bool = False, deq_dtype: torch.dtype | None = None,
    write_mask: bool = False, err: torch.Tensor | None = None, fast_div: bool | None = None,
    into: dict[str, torch.Tensor] | None = None, into_row: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Launch ``quant_kernel`` on x2d [M, K] (unit stride along K). Returns the asked outputs by name.

    ``g``: fp32 amax, 1 element (G_SCALAR) or [M] (G_ROW_GIVEN); G_ROW_COMPUTE returns it as ``"g"``.
    ``scales_in`` [M, NB] uint8 and ``guide`` (packed codes [M, Kp/2] or bits [M, Kp/8]) for guided modes.
    ``into`` (RNE): preallocated ``"codes"`` [M, Kp/2], ``"scales"`` [M, NB] (uint8) and, for G_ROW_COMPUTE, ``"g"``
    [M, 1] (fp32) views, rows at one common step (``into_step``), written in place: by ``pair_kernel`` itself, or
    (the element kernel) copied from fresh outputs. ``into_row`` (int64 [1] on the device): row r goes to view row
    r * step + into_row[0] instead (``pair_kernel`` only: a static KV cache's decode position).
    """
    m, k = x2d.shape
    nb = cdiv(k, block)
    kp = nb * block
    dev = x2d.device
    u8 = torch.uint8
    spare = torch.empty(1, dtype=u8, device=dev)
    pair = pair_ok(x2d, block, deq_dtype)
    if into_row is not None and (into is None or not pair):
        raise ValueError("into_row needs into and rows the pair kernel takes (whole blocks, bf16/fp16/fp32 pairs)")
    step = None if into is None else into_step(into, m, {"codes": kp // 2, "scales": nb, "g": 1}, dev)
    out = dict(into) if into is not None and pair else {}
    if "g" in out:
        g = out["g"]
    if write_codes and "codes" not in out:
        out["codes"] = torch.empty((m, kp // 2), dtype=u8, device=dev)
    if write_scales and "scales" not in out:
        out["scales"] = torch.empty((m, nb), dtype=u8, device=dev)
    if write_bits:
        out["bits"] = torch.empty((m, kp // 8), dtype=u8, device=dev)
    if deq_dtype is not None:
        out["deq"] = torch.empty((m, k), dtype=deq_dtype, device=dev)
    if write_mask:
        out["mask"] = torch.empty((m, k), dtype=u8, device=dev)
    if int(g_mode) == int(G_ROW_COMPUTE) and "g" not in out:
        g = out["g"] = torch.empty(m, dtype=torch.float32, device=dev)
    if m == 0:
        return out
    args = dict(g=g, scales_in=scales_in, guide=guide, err=err, spare=spare, fmt=fmt, block=block, mode=mode,
                g_mode=g_mode, write_codes=write_codes, write_scales=write_scales, write_bits=write_bits,
                write_mask=write_mask, fast_div=FAST_DIV if fast_div is None else fast_div)
    if pair:
        from . import pair_launch  # imports this module's constants

        pair_launch.launch_pair(x2d, out, out_step=step, out_row=into_row, **args)
    else:
        _launch_elem(x2d, out, CONFIG["elem"], keep_nonfinite=err is not None, **args)
        for name, t in (into or {}).items():  # the element kernel writes contiguous rows: copy them into place
            out[name] = t.copy_(out[name].view(t.shape))
    return out


def into_step(into: dict[str, torch.Tensor], m: int, widths: dict[str, int], device) -> int:
    """The row step of ``run_quant``'s ``into`` views: each [M, width] (unit stride along width) holds row r at
    r * step * width elements from its start, with one step for all (e.g. rows of ``[B, H, capacity, width]``
    buffers at one position: step = capacity). Raises ``ValueError`` naming a view that does not fit."""
    steps = set()
    for name, t in into.items():
        w = widths.get(name)
        if w is None:
            raise ValueError(f"into has {name=}, expected some of {sorted(widths)}")
        dtype = torch.float32 if name == "g" else torch.uint8
        if tuple(t.shape) != (m, w) or t.dtype != dtype or t.device != torch.device(device):
            raise ValueError(f"into[{name!r}] must be {dtype} [{m}, {w}] on {device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
        if (w > 1 and t.stride(1) != 1) or (m > 1 and (t.stride(0) < w or t.stride(0) % w)):
            raise ValueError(f"into[{name!r}] rows must be unit-stride and {w} elements apart times a step, got "
                             f"strides {t.stride()}")
        if m > 1:
            steps.add(t.stride(0) // w)
    if len(steps) > 1:
        raise ValueError(f"into's views must share one row step (row stride / row width), got {sorted(steps)}")
    return steps.pop() if steps else 1


def _launch_elem(x2d, out, cfg, *, g, scales_in, guide, err, spare, fmt, block, mode, g_mode, write_codes,
                 write_scales, write_bits, write_mask, fast_div, keep_nonfinite):
    """Launch ``quant_kernel`` into the buffers of ``out``."""
    m, k = x2d.shape
    nb = cdiv(k, block)
    bm, nbt, num_kt = plan(nb * block, block, cfg["tile"])
    quant_kernel[(cdiv(m, bm),)](
        x2d, m, k, x2d.stride(0), nb, num_kt,
        g if g is not None else spare, scales_in if scales_in is not None else spare,
        guide if guide is not None else spare,
        out.get("codes", spare), out.get("scales", spare), out.get("bits", spare),
        out.get("deq", x2d), out.get("mask", spare), err if err is not None else spare,
        FMT=int(fmt), MODE=int(mode), G_MODE=int(g_mode), B=block, BLOCK_M=bm, NBT=nbt, SINGLE_TILE=num_kt == 1,
        WRITE_CODES=write_codes, WRITE_SCALES=write_scales, WRITE_BITS=write_bits,
        WRITE_DEQ="deq" in out, WRITE_MASK=write_mask, CHECK_FINITE=err is not None,
        FAST_DIV=fast_div, KEEP_NONFINITE=keep_nonfinite, num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )


def register_cap(cfg: dict, t: torch.Tensor) -> dict:
    """``maxnreg`` for a launch of config ``cfg`` on ``t``'s device where cfg names "max_registers" (a compiler
    option of the GPU build; the interpreter has none)."""
    cap = cfg.get("max_registers")
    return {"maxnreg": cap} if cap and not interpreting(t) else {}


def multiprocessors(t: torch.Tensor) -> int:
    """Streaming multiprocessors of ``t``'s GPU; 1 in the interpreter (a prefetching grid then loops over row
    groups in few programs, which the tests exercise)."""
    return 1 if interpreting(t) else sm_count(t.device)


def interpreting(t: torch.Tensor) -> bool:
    """A Triton launch on a non-CUDA tensor runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``), which
    emulates hardware conversions differently: the kernels then take their bit-arithmetic paths."""
    return not t.is_cuda
