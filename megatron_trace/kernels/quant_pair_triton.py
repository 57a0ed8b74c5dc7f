"""Triton quantize kernel for rows of whole blocks, read as element pairs (``pair_kernel``).

x is read as 32-bit words of two elements (64-bit for fp32), so the two codes of a word are one packed byte:
no reshape or shuffle for the nibble packing. One reciprocal per block and one Markstein step per element
replace the IEEE division; the RNE / guided codeword comes from bit tricks (``triton_fp4.rne_index``,
``compact_index``, ``full_code``); RNE and guided NVFP4 rounding of bf16/fp32 rows take the tiles of
``quant_rne_triton`` and ``quant_guided_triton`` instead (by fp32 magnitudes), and MXFP4 codes of bf16 rows that of
``quant_mx_triton`` (by packed bf16 pairs). A tile where the fast division may be inexact (tiny/huge amax, Inf,
a checked NaN/Inf) is redone in the same program by ``quant_triton``'s element-wise tile (IEEE division): one
launch per call. Same modes and outputs as ``quant_triton.quant_kernel``.
OUT_ROWS (RNE): row r's codes, scales and computed amax go to output row r * out_step, e.g. one position of a
``[B, H, capacity, ...]`` buffer (the FP4 KV cache's decode write); other outputs keep row r.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import quant_guided_triton as qg
from . import quant_mx_triton as mx
from . import quant_rne_triton as qr
from . import quant_triton as qk
from . import triton_fp4 as f
from .quant_triton import G_NONE, G_ROW_COMPUTE, G_ROW_GIVEN, G_SCALAR, GUIDED_COMPACT, GUIDED_FULL, RNE, _block_scales


@triton.jit
def _load_words(xw_ptr, rows, rmask, stride_w, kt, NW, NBT: tl.constexpr, P: tl.constexpr, WHOLE: tl.constexpr):
    """Words (element pairs) of x for blocks [kt*NBT, (kt+1)*NBT) as [BM, NBT, P] (unsigned), their columns and
    mask; WHOLE: a thread holds whole blocks (``triton_fp4.load_words``)."""
    wcol = kt * (NBT * P) + tl.arange(0, NBT)[None, :, None] * P + tl.arange(0, P)[None, None, :]
    mask = rmask[:, None, None] & (wcol < NW)
    if WHOLE:
        w = f.load_words(xw_ptr, rows, rmask, stride_w, kt, NW, NBT, P)
    else:
        w = tl.load(xw_ptr + rows[:, None, None] * stride_w + wcol, mask=mask, other=0)
    if w.dtype == tl.int64:
        w = w.to(tl.uint64, bitcast=True)
    else:
        w = w.to(tl.uint32, bitcast=True)
    return w, wcol, mask


@triton.jit
def _pair_tile(w, wcol, m3, amax_b, kt, rows, orows, rmask, NB, s_b, gc_ptr, codes_ptr, scales_ptr, bits_ptr, deq_ptr,
               mask_ptr, XDT: tl.constexpr, FMT: tl.constexpr, MODE: tl.constexpr, P: tl.constexpr,
               NBT: tl.constexpr, s_in_ptr, WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr,
               WRITE_BITS: tl.constexpr, WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr,
               FAST_DIV: tl.constexpr, HW_CVT: tl.constexpr):
    """RNE or guided quantize of a tile of element pairs [BM, NBT, P] (s_b: S_enc as [BM, 1]).

    Each word's two elements become the two nibbles of one code byte, so packing stays in registers. Codes and
    scales go to rows ``orows`` (``rows`` unless OUT_ROWS).
    """
    lo, hi = f.unpair(w, XDT)
    blk = kt * NBT + tl.arange(0, NBT)[None, :]  # [1, NBT]
    bmask = blk < NB
    sf, byte, e = _block_scales(amax_b, blk, rows, rmask, bmask, s_b, s_in_ptr, NB, FMT, MODE)  # [BM, NBT] each
    if FMT == f.NVFP4:
        ok = sf > 0.0
        den = tl.where(ok, sf, 1.0)
        s3 = s_b[:, :, None]
        al, ah = lo * s3, hi * s3
        if FAST_DIV:
            rb = tl.where(ok, tl.div_rn(tl.full(den.shape, 1.0, tl.float32), den), 0.0)[:, :, None]
            nd = -den[:, :, None]  # per block, so the per-element remainder is one fma
            zl = f.markstein(al, nd, rb)
            zh = f.markstein(ah, nd, rb)
        else:
            zl = tl.where(ok[:, :, None], tl.div_rn(al, den[:, :, None]), 0.0)
            zh = tl.where(ok[:, :, None], tl.div_rn(ah, den[:, :, None]), 0.0)
        sgn = tl.where(ok, 8, 0)[:, :, None]  # z = +0 where the block scale is 0
    else:
        p2 = f.pow2(-e)[:, :, None]
        zl, zh = lo * p2, hi * p2
        sgn = tl.full([1, 1, 1], 8, tl.int32)
    neg_l = ((lo.to(tl.int32, bitcast=True) >> 28) & sgn)
    neg_h = ((hi.to(tl.int32, bitcast=True) >> 28) & sgn)
    woff = rows[:, None, None] * (NB * P) + blk[:, :, None] * P + tl.arange(0, P)[None, None, :]
    if MODE == RNE:
        il, ih = f.rne_index(zl), f.rne_index(zh)
        cl, ch = il | neg_l, ih | neg_h  # codes of the even / odd elements, int32
    elif MODE == GUIDED_COMPACT:
        BM: tl.constexpr = w.shape[0]
        boff = rows[:, None, None] * (NB * P // 4) + blk[:, :, None] * (P // 4) + tl.arange(0, P // 4)[None, None, :]
        gb = tl.load(gc_ptr + boff, mask=rmask[:, None, None] & bmask[:, :, None], other=0).to(tl.int32)
        gb = tl.broadcast_to(gb[:, :, :, None], [BM, NBT, P // 4, 4]).reshape(BM, NBT, P)  # byte of each pair
        gb = gb >> (2 * (tl.arange(0, P) % 4))[None, None, :]
        il, ih = f.compact_index(zl, gb & 1), f.compact_index(zh, (gb >> 1) & 1)
        cl, ch = il | neg_l, ih | neg_h
    else:
        rc = tl.load(gc_ptr + woff, mask=m3, other=0).to(tl.int32)  # the record's code byte of each pair
        cl, ch = f.full_code(zl, neg_l, rc & 15), f.full_code(zh, neg_h, rc >> 4)
        il, ih = cl & 7, ch & 7
    if WRITE_CODES:
        coff = orows[:, None, None] * (NB * P) + blk[:, :, None] * P + tl.arange(0, P)[None, None, :]
        tl.store(codes_ptr + coff, (cl | (ch << 4)).to(tl.uint8), mask=m3)
    if WRITE_SCALES:  # (by the GPU's byte stores, in the layout of the blocks: no exchange through shared memory)
        f.store_u8(scales_ptr + orows[:, None] * NB + blk, byte, rmask[:, None] & bmask, HW_CVT)
    if WRITE_BITS:
        qr.store_bits(il, ih, bits_ptr, rows, rmask, blk, bmask, NB, P, NBT)
    if WRITE_DEQ:
        vl, vh = f.deq_mags(il, ih, sf[:, :, None], e[:, :, None], s_b[:, :, None], FMT, FAST_DIV)
        vl = (vl.to(tl.int32, bitcast=True) | ((cl & 8) << 28)).to(tl.float32, bitcast=True)  # code sign
        vh = (vh.to(tl.int32, bitcast=True) | ((ch & 8) << 28)).to(tl.float32, bitcast=True)
        DDT: tl.constexpr = 2 if deq_ptr.dtype.element_ty == tl.int64 else XDT
        words = f.pair(vl, vh, DDT, HW_CVT).to(deq_ptr.dtype.element_ty, bitcast=True)
        f.store_words(deq_ptr, rows, rmask, kt, NB * P, words, NBT, P, False)
    if WRITE_MASK:
        ml = (tl.abs(zl) <= 6.0).to(tl.uint16)
        mh = (tl.abs(zh) <= 6.0).to(tl.uint16)
        f.store_words(mask_ptr, rows, rmask, kt, NB * P, (ml | (mh << 8)).to(tl.int16, bitcast=True), NBT, P,
                      False)


@triton.jit
def _needs_exact(lo_hi_amax, s_b, G_MODE: tl.constexpr, MODE: tl.constexpr, WRITE_DEQ: tl.constexpr,
                 HW: tl.constexpr):
    """1 when the tile may leave the range where the reciprocal division is exact (``quant_kernel`` redoes it).
    On the GPU a row amax computed here is +Inf wherever a block amax is (its max ignores NaN, unlike the
    interpreter's), so S_enc = 0 flags the tile: no reduction of the block amaxes across the program. MXFP4
    (G_NONE) is never flagged: its fast tile divides by nothing (z = x * 2**-e), and ``triton_fp4.rne_index``
    saturates an Inf z to 7 as the exact tile does."""
    INF_CHECK: tl.constexpr = MODE == RNE and G_MODE != G_NONE and not (HW and G_MODE == G_ROW_COMPUTE)
    bad = tl.max(tl.max((lo_hi_amax == float("inf")).to(tl.int32), axis=1), axis=0) if INF_CHECK else 0
    if G_MODE != G_NONE:
        sb = s_b.to(tl.int32, bitcast=True)
        r = (sb < 0x0D000000) | (sb >= 0x72000000)  # S_enc outside [2^-101, 2^101]
        if WRITE_DEQ:
            r = r | ((sb & 0x7FFFFF) == 0x7FFFFF)
        bad += tl.max(tl.max(r.to(tl.int32), axis=1), axis=0)
    return bad


@triton.jit
def pair_kernel(
    xw_ptr, x_ptr, M, stride_w, NB, NUM_KT: tl.constexpr,
    g_ptr, s_in_ptr, gc_ptr,
    codes_ptr, scales_ptr, bits_ptr, deq_ptr, deq_e_ptr, mask_ptr, mask_e_ptr, err_ptr,
    XDT: tl.constexpr, FMT: tl.constexpr, MODE: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr,
    BLOCK_M: tl.constexpr, NBT: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr, WRITE_BITS: tl.constexpr,
    WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, CHECK_FINITE: tl.constexpr, FAST_DIV: tl.constexpr,
    HW_CVT: tl.constexpr, BY_MAG: tl.constexpr, EVEN_K: tl.constexpr, out_step=1, OUT_ROWS: tl.constexpr = False,
    row_ptr=None, ROW_AT: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    """``quant_kernel`` for K % B == 0 on x read as words of two elements (deq/mask as words too).

    x_ptr, deq_e_ptr and mask_e_ptr are the same buffers as elements, for the exact redo of a tile. EVEN_K: the
    row's NB blocks are NUM_KT whole tiles, so NB is a constant and the tiles need no column masks. OUT_ROWS (RNE
    only): codes, scales and a computed per-row amax of row r are written at row r * out_step of their buffers,
    plus ``row_ptr[0]`` with ROW_AT (a device row: a static KV cache's decode position, read at run time).
    PREFETCH (NUM_KT == 1, not OUT_ROWS): a grid smaller than the row groups; program p rounds groups p, p + grid, ...
    and issues each next group's loads (x's words, the record's scales and bits, a given row amax) before it rounds
    the current one, so that loads stay in flight while it computes (``quant_triton.CONFIG``'s "programs_per_sm").
    """
    if EVEN_K:
        NB = NUM_KT * NBT
    P: tl.constexpr = B // 2
    GUIDED_LOADS: tl.constexpr = MODE if BY_MAG else 0  # the guided mode of a tile by magnitudes: whole blocks
    # whole blocks per thread also for RNE codes of bf16 rows without a dequantized output: their code words
    WHOLE: tl.constexpr = GUIDED_LOADS != 0 or (BY_MAG and MODE == RNE and XDT == 0 and not WRITE_DEQ
                                           and not WRITE_MASK)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    if OUT_ROWS:
        orows = rows * out_step
        if ROW_AT:
            orows += tl.load(row_ptr)
    else:
        orows = rows
    NW = NB * P
    if NUM_KT == 1 and PREFETCH:  # row groups pid, pid + grid, ...: each issues the next group's loads first
        # The loads read rows clamped to M - 1 instead of masked (a row past M is loaded but never stored):
        # no per-load predicates or zero fills in the loop.
        w, wcol, sfb, g16, g1 = _group_loads(xw_ptr, g_ptr, s_in_ptr, gc_ptr, tl.minimum(rows, M - 1),
                                             stride_w, NB, NW, NBT, P, G_MODE, GUIDED_LOADS, WHOLE, HW_CVT)
        nprog = tl.num_programs(0)
        grp = pid
        n_grp = tl.cdiv(M, BLOCK_M)
        while grp < n_grp:  # two groups per trip, so that the two sets of loads swap roles without copies
            # (a while loop: the interpreter's range() takes no program id)
            w_n, sfb_n, g16_n, g1_n = _prefetch_step(
                w, wcol, sfb, g16, g1, grp, nprog, xw_ptr, x_ptr, M, stride_w, NB, NW, g_ptr, s_in_ptr, gc_ptr,
                codes_ptr, scales_ptr, bits_ptr, deq_ptr, deq_e_ptr, mask_ptr, mask_e_ptr, err_ptr, XDT, FMT, MODE,
                G_MODE, B, BLOCK_M, NBT, WRITE_CODES, WRITE_SCALES, WRITE_BITS, WRITE_DEQ, WRITE_MASK, CHECK_FINITE,
                FAST_DIV, HW_CVT, BY_MAG, GUIDED_LOADS, WHOLE)
            grp += nprog
            if grp < n_grp:
                w, sfb, g16, g1 = _prefetch_step(
                    w_n, wcol, sfb_n, g16_n, g1_n, grp, nprog, xw_ptr, x_ptr, M, stride_w, NB, NW, g_ptr,
                    s_in_ptr, gc_ptr, codes_ptr, scales_ptr, bits_ptr, deq_ptr, deq_e_ptr, mask_ptr, mask_e_ptr,
                    err_ptr, XDT, FMT, MODE, G_MODE, B, BLOCK_M, NBT, WRITE_CODES, WRITE_SCALES, WRITE_BITS,
                    WRITE_DEQ, WRITE_MASK, CHECK_FINITE, FAST_DIV, HW_CVT, BY_MAG, GUIDED_LOADS, WHOLE)
                grp += nprog
    elif NUM_KT == 1:  # the whole row group in one tile: x is read once (rows clamped, as above)
        rows_in = rows if BLOCK_M == 1 else tl.minimum(rows, M - 1)  # (one row per program: row pid < M)
        w, wcol, sfb, g16, _ = _group_loads(xw_ptr, g_ptr, s_in_ptr, gc_ptr, rows_in,
                                            stride_w, NB, NW, NBT, P, G_NONE, GUIDED_LOADS, WHOLE, HW_CVT)
        m3 = rmask[:, None, None] & (wcol < NW)
        amax_b = f.block_amax(w, XDT, HW_CVT)  # [BM, NBT]
        s_b = _pair_s_enc(amax_b, xw_ptr, g_ptr, rows, orows, rmask, stride_w, NW, XDT, G_MODE, NUM_KT, NBT, P)
        _pair_step(w, wcol, m3, amax_b, 0, x_ptr, rows, orows, rmask, stride_w, NB, s_b, sfb, g16, s_in_ptr, gc_ptr,
                   codes_ptr, scales_ptr, bits_ptr, deq_ptr, deq_e_ptr, mask_ptr, mask_e_ptr, err_ptr, XDT, FMT, MODE,
                   G_MODE, B, NBT, WRITE_CODES, WRITE_SCALES, WRITE_BITS, WRITE_DEQ, WRITE_MASK, CHECK_FINITE,
                   FAST_DIV, HW_CVT, BY_MAG, OUT_ROWS)
    else:
        s_b = _pair_s_enc(tl.zeros([BLOCK_M, NBT], tl.float32), xw_ptr, g_ptr, rows, orows, rmask, stride_w, NW,
                          XDT, G_MODE, NUM_KT, NBT, P)
        for kt in range(NUM_KT):
            w, wcol, m3 = _load_words(xw_ptr, rows, rmask, stride_w, kt, NW, NBT, P, WHOLE)
            sfb, g16 = _guided_loads(rows, rmask, kt, NB, gc_ptr, s_in_ptr, NBT, GUIDED_LOADS, HW_CVT)
            amax_b = f.block_amax(w, XDT, HW_CVT)
            _pair_step(w, wcol, m3, amax_b, kt, x_ptr, rows, orows, rmask, stride_w, NB, s_b, sfb, g16, s_in_ptr,
                       gc_ptr, codes_ptr, scales_ptr, bits_ptr, deq_ptr, deq_e_ptr, mask_ptr, mask_e_ptr, err_ptr, XDT,
                       FMT, MODE, G_MODE, B, NBT, WRITE_CODES, WRITE_SCALES, WRITE_BITS, WRITE_DEQ, WRITE_MASK,
                       CHECK_FINITE, FAST_DIV, HW_CVT, BY_MAG, OUT_ROWS)


@triton.jit
def _prefetch_step(w, wcol, sfb, g16, g1, grp, nprog, xw_ptr, x_ptr, M, stride_w, NB, NW, g_ptr, s_in_ptr,
                   gc_ptr, codes_ptr, scales_ptr, bits_ptr, deq_ptr, deq_e_ptr, mask_ptr, mask_e_ptr, err_ptr,
                   XDT: tl.constexpr, FMT: tl.constexpr, MODE: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr,
                   BLOCK_M: tl.constexpr, NBT: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr,
                   WRITE_BITS: tl.constexpr, WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr,
                   CHECK_FINITE: tl.constexpr, FAST_DIV: tl.constexpr, HW_CVT: tl.constexpr, BY_MAG: tl.constexpr,
                   GUIDED_LOADS: tl.constexpr, WHOLE: tl.constexpr):
    """One trip of ``pair_kernel``'s prefetching loop: issue the loads of row group grp + nprog (rows clamped to
    M - 1), then round group grp from its loads (w, sfb, g16, g1); returns the next group's loads."""
    P: tl.constexpr = B // 2
    rows_n = tl.minimum((grp + nprog).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M), M - 1)
    w_n, _, sfb_n, g16_n, g1_n = _group_loads(xw_ptr, g_ptr, s_in_ptr, gc_ptr, rows_n, stride_w, NB, NW,
                                              NBT, P, G_MODE, GUIDED_LOADS, WHOLE, HW_CVT)
    rows = grp.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    m3 = rmask[:, None, None] & (wcol < NW)
    amax_b = f.block_amax(w, XDT, HW_CVT)  # [BM, NBT]
    if G_MODE == G_ROW_GIVEN:
        s_b = f.nvfp4_encode_scale(g1)[:, None]
    else:
        s_b = _pair_s_enc(amax_b, xw_ptr, g_ptr, rows, rows, rmask, stride_w, NW, XDT, G_MODE, 1, NBT, P)
    _pair_step(w, wcol, m3, amax_b, 0, x_ptr, rows, rows, rmask, stride_w, NB, s_b, sfb, g16, s_in_ptr, gc_ptr,
               codes_ptr, scales_ptr, bits_ptr, deq_ptr, deq_e_ptr, mask_ptr, mask_e_ptr, err_ptr, XDT, FMT, MODE,
               G_MODE, B, NBT, WRITE_CODES, WRITE_SCALES, WRITE_BITS, WRITE_DEQ, WRITE_MASK, CHECK_FINITE, FAST_DIV,
               HW_CVT, BY_MAG, False)
    return w_n, sfb_n, g16_n, g1_n


@triton.jit
def _guided_loads(rows, rmask, kt, NB, gc_ptr, s_in_ptr, NBT: tl.constexpr, GUIDED_LOADS: tl.constexpr,
                  HW: tl.constexpr):
    """``quant_guided_triton.guided_loads`` where a guided tile by magnitudes runs (GUIDED_LOADS: its mode, else
    0), else zeros (unused)."""
    if GUIDED_LOADS != 0:
        return qg.guided_loads(rows, rmask, kt, NB, gc_ptr, s_in_ptr, NBT, GUIDED_LOADS == GUIDED_FULL, HW)
    else:
        z = tl.zeros([rows.shape[0], NBT], tl.int32)
        return z, z


@triton.jit
def _group_loads(xw_ptr, g_ptr, s_in_ptr, gc_ptr, rows, stride_w, NB, NW, NBT: tl.constexpr, P: tl.constexpr,
                 G_MODE: tl.constexpr, GUIDED_LOADS: tl.constexpr, WHOLE: tl.constexpr, HW: tl.constexpr):
    """A one-tile row group's loads, unmasked (rows < M: the callers clamp them): x's words and their columns, the
    record's (``_guided_loads``) and, for G_ROW_GIVEN, the rows' amax (else zeros)."""
    every = tl.full(rows.shape, 1, tl.int1)
    w, wcol, _ = _load_words(xw_ptr, rows, every, stride_w, 0, NW, NBT, P, WHOLE)
    sfb, g16 = _guided_loads(rows, every, 0, NB, gc_ptr, s_in_ptr, NBT, GUIDED_LOADS, HW)
    if G_MODE == G_ROW_GIVEN:
        g1 = tl.load(g_ptr + rows)
    else:
        g1 = tl.zeros([rows.shape[0]], tl.float32)
    return w, wcol, sfb, g16, g1


@triton.jit
def _pair_s_enc(amax_b, xw_ptr, g_ptr, rows, orows, rmask, stride_w, NW, XDT: tl.constexpr, G_MODE: tl.constexpr,
                NUM_KT: tl.constexpr, NBT: tl.constexpr, P: tl.constexpr):
    """S_enc as [BM, 1] (1.0 for MXFP4); a per-row amax is taken from amax_b [BM, NBT] when NUM_KT == 1 (and
    stored at rows ``orows`` of g_ptr)."""
    BM: tl.constexpr = amax_b.shape[0]
    if G_MODE == G_SCALAR:
        s_b = f.nvfp4_encode_scale(tl.load(g_ptr) + tl.zeros([BM, 1], tl.float32))
    elif G_MODE == G_NONE:
        s_b = tl.full([BM, 1], 1.0, tl.float32)
    else:
        if G_MODE == G_ROW_COMPUTE:
            if NUM_KT == 1:
                g1 = tl.max(amax_b, axis=1)
            else:
                g1 = tl.zeros([BM], tl.float32)
                for kt in range(NUM_KT):
                    w, _, _ = _load_words(xw_ptr, rows, rmask, stride_w, kt, NW, NBT, P, False)
                    lo, hi = f.unpair(w, XDT)
                    g1 = tl.maximum(g1, tl.max(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=2), axis=1))
            tl.store(g_ptr + orows, g1, mask=rmask)
        else:
            g1 = tl.load(g_ptr + rows, mask=rmask, other=1.0)
        s_b = f.nvfp4_encode_scale(g1)[:, None]  # [BM, 1]
    return s_b


@triton.jit
def _pair_step(w, wcol, m3, amax_b, kt, x_ptr, rows, orows, rmask, stride_w, NB, s_b, sfb, g16, s_in_ptr, gc_ptr,
               codes_ptr, scales_ptr, bits_ptr, deq_ptr, deq_e_ptr, mask_ptr, mask_e_ptr, err_ptr, XDT: tl.constexpr,
               FMT: tl.constexpr, MODE: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr, NBT: tl.constexpr,
               WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr, WRITE_BITS: tl.constexpr,
               WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, CHECK_FINITE: tl.constexpr,
               FAST_DIV: tl.constexpr, HW_CVT: tl.constexpr, BY_MAG: tl.constexpr, OUT_ROWS: tl.constexpr):
    """One K tile: the NaN/Inf check if asked, then ``_fast_tile`` (sfb, g16: the record's ``guided_loads`` for the
    guided tiles by magnitudes, g16 being a block's 8 code bytes for full guidance, else unused); a tile that may
    leave the range where the fast division is exact, or holds a checked NaN/Inf, takes the element-wise exact path
    instead (which counts the checked NaN/Inf values and passes them through to the dequantized output). Codes and
    scales go to rows ``orows``."""
    if not (CHECK_FINITE or G_MODE != G_NONE):  # unchecked MXFP4: exact as it is, so no redo and no branch
        _fast_tile(w, wcol, m3, amax_b, kt, rows, orows, rmask, NB, s_b, sfb, g16, s_in_ptr, gc_ptr, codes_ptr,
                   scales_ptr, bits_ptr, deq_ptr, mask_ptr, XDT, FMT, MODE, B, NBT, WRITE_CODES, WRITE_SCALES,
                   WRITE_BITS, WRITE_DEQ, WRITE_MASK, FAST_DIV, HW_CVT, BY_MAG)
    else:
        if CHECK_FINITE:
            lo, hi = f.unpair(w, XDT)
            ab = tl.maximum(lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF, hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
            bad = tl.max(tl.max(tl.max(ab, axis=2), axis=1), axis=0) >= 0x7F800000  # an Inf or NaN in the tile
        slow = _needs_exact(amax_b, s_b, G_MODE, MODE, WRITE_DEQ, HW_CVT)
        if CHECK_FINITE:
            slow += bad.to(tl.int32)
        if MODE != RNE and FMT == f.NVFP4 and FAST_DIV and not BY_MAG:  # guided: z == 0 must be exact for tiny z
            lo, hi = f.unpair(w, XDT)
            t3 = tl.div_rn(tl.full(s_b.shape, 2.0**-99, tl.float32), s_b)[:, :, None]  # per row, 2x margin
            tiny = ((tl.abs(lo) < t3) & (lo != 0.0)) | ((tl.abs(hi) < t3) & (hi != 0.0))  # 0 < |x * S_enc| < 2^-100
            slow += tl.max(tl.max(tl.max(tiny.to(tl.int32), axis=2), axis=1), axis=0)
        if slow == 0:
            _fast_tile(w, wcol, m3, amax_b, kt, rows, orows, rmask, NB, s_b, sfb, g16, s_in_ptr, gc_ptr, codes_ptr,
                       scales_ptr, bits_ptr, deq_ptr, mask_ptr, XDT, FMT, MODE, B, NBT, WRITE_CODES, WRITE_SCALES,
                       WRITE_BITS, WRITE_DEQ, WRITE_MASK, FAST_DIV, HW_CVT, BY_MAG)
        else:  # a quarter row at a time: the redo's live values stay below the fast path's registers
            K = NB * B
            BM: tl.constexpr = w.shape[0]
            NBR: tl.constexpr = NBT // 4 if NBT >= 4 else NBT
            for r in range(BM):
                sel = tl.arange(0, BM) == r
                row = tl.sum(tl.where(sel, rows, 0), axis=0) + tl.zeros([1], tl.int64)
                ok = tl.sum(tl.where(sel, rmask.to(tl.int32), 0), axis=0) + tl.zeros([1], tl.int32) > 0
                s1 = tl.sum(tl.where(sel[:, None], s_b, 0.0), axis=0)[None, :]  # [1, 1]
                c_ptr, sc_ptr = codes_ptr, scales_ptr
                if OUT_ROWS:  # the element tile writes row ``row``: shift its codes / scales bases to row orows[r]
                    d = tl.sum(tl.where(sel, orows - rows, 0), axis=0)
                    c_ptr, sc_ptr = codes_ptr + d * (NB * (B // 2)), scales_ptr + d * NB
                for h in range(NBT // NBR):
                    kr = kt * (NBT // NBR) + h
                    x, col = qk._load_tile(x_ptr, row, ok, stride_w * 2, kr * NBR * B, K, NBR, B)
                    qk._tile(x, col, kr, row, ok, K, NB, s1, s1[:, :, None], s_in_ptr, gc_ptr, c_ptr, sc_ptr,
                             bits_ptr, deq_e_ptr, mask_e_ptr, err_ptr, FMT, MODE, B, NBR, WRITE_CODES, WRITE_SCALES,
                             WRITE_BITS, WRITE_DEQ, WRITE_MASK, CHECK_FINITE, False, CHECK_FINITE)  # (counts them)


@triton.jit
def _fast_tile(w, wcol, m3, amax_b, kt, rows, orows, rmask, NB, s_b, sfb, g16, s_in_ptr, gc_ptr, codes_ptr,
               scales_ptr, bits_ptr, deq_ptr, mask_ptr, XDT: tl.constexpr, FMT: tl.constexpr, MODE: tl.constexpr,
               B: tl.constexpr, NBT: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr,
               WRITE_BITS: tl.constexpr, WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, FAST_DIV: tl.constexpr,
               HW_CVT: tl.constexpr, BY_MAG: tl.constexpr):
    """A K tile in range by the fast division: the tile by magnitudes (NVFP4 RNE, guided compact or full; BY_MAG),
    MXFP4 codes of bf16 by packed pairs (BY_MAG) or ``_pair_tile``."""
    if BY_MAG and FMT != f.NVFP4:  # MXFP4 RNE codes / record of bf16 pairs (``pair_launch._by_magnitude``)
        mx.mx_rne_tile(w, amax_b, kt, rows, orows, rmask, NB, codes_ptr, scales_ptr, bits_ptr, FMT, B // 2, NBT,
                       WRITE_CODES, WRITE_SCALES, WRITE_BITS, HW_CVT)
    elif BY_MAG and MODE == RNE:  # RNE / guided compact NVFP4 by magnitudes; fp16 keeps the index path
        qr.rne_tile(w, wcol, m3, amax_b, kt, rows, orows, rmask, NB, s_b, codes_ptr, scales_ptr, bits_ptr, deq_ptr,
                    mask_ptr, XDT, B // 2, NBT, WRITE_CODES, WRITE_SCALES, WRITE_BITS, WRITE_DEQ, WRITE_MASK,
                    FAST_DIV, HW_CVT)
    elif BY_MAG and MODE == GUIDED_FULL:
        qg.guided_full_tile(w, wcol, m3, kt, rows, rmask, NB, s_b, sfb, g16, codes_ptr, deq_ptr, mask_ptr, XDT,
                            B // 2, NBT, WRITE_CODES, WRITE_DEQ, WRITE_MASK, FAST_DIV, HW_CVT)
    elif BY_MAG:
        qg.guided_compact_tile(w, wcol, m3, kt, rows, rmask, NB, s_b, sfb, g16, codes_ptr, deq_ptr, mask_ptr, XDT,
                               B // 2, NBT, WRITE_CODES, WRITE_DEQ, WRITE_MASK, FAST_DIV, HW_CVT)
    else:
        _pair_tile(w, wcol, m3, amax_b, kt, rows, orows, rmask, NB, s_b, gc_ptr, codes_ptr, scales_ptr, bits_ptr,
                   deq_ptr, mask_ptr, XDT, FMT, MODE, B // 2, NBT, s_in_ptr, WRITE_CODES, WRITE_SCALES,
                   WRITE_BITS, WRITE_DEQ, WRITE_MASK, FAST_DIV, HW_CVT)
