"""RNE NVFP4 rounding of element pairs by magnitudes: the pair kernel's tile for ``RNE`` (fake-quant, record).

``quant_pair_triton._pair_tile`` finds an E2M1 index per element (``triton_fp4.rne_index``) and dequantizes it with
a multiply and a division per element. This tile rounds the fp32 value itself and dequantizes the grid point's
bits (same results, bit for bit; the way ``quant_guided_triton`` does guided compact rounding):

- ``rne_sum``: with a = min(|z|, 6) and p = 2**e, e = max(floor(log2 a), 0) (0..2), C = p * 2**22 has an ulp of
  2**(e - 1), the E2M1 grid step of a's binade (0.5 below 2, then 1, 2), and a + C stays in C's binade, so the
  sum t = a + C (one fma: p * 2**22 is exact) rounds a to the grid with ties to even (even multiples of the step
  are the grid points of mantissa bit 0: 0 | 0.5 | 1 at 0.25 and 0.75, 1 | 1.5 | 2, 2 | 3 | 4, 4 | 6 at 5).
  t - C is exact: the grid point (``sum_to_mag``); bits(t) - bits(C) counts steps, plus 2e it is the E2M1 index
  (``sum_to_index``, ``triton_fp4.rne_index``'s rule). a <= 0.25 (zero, subnormal) gives t = C, so 0; z > 6 and
  Inf saturate to 6 (NaN too, as the index path's 7). p * 2**22 is exact, so the interpreter's unfused fma agrees.
- Dequantization: ``quant_guided_triton.deq_mag``: 2**k times d1 = RN(sf / S_enc) or d3 = RN(1.5 sf / S_enc)
  (rounded to bf16 first for bf16 output), the sign from x's word (+0 where the block scale is 0).
- STE mask: |z| <= 6. Codes: the index | the sign of x (+ where the block scale is 0); the record's bit: the
  index's bit 0 (the E2M1 mantissa bit; 0.5 has 1).
Grid point and index checked against the reference's tie table for every non-negative fp32 bit pattern.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import quant_guided_triton as qg
from . import triton_fp4 as f


@triton.jit
def rne_sum(z):
    """(t, p, |z| <= 6) for fp32 z: a = min(|z|, 6) (NaN -> 6), p = 2**e (fp32), t = a + p * 2**22 in one
    rounding: a on the E2M1 grid (see the module docstring)."""
    za = tl.abs(z)
    inside = za <= 6.0
    a = tl.where(inside, za, 6.0)
    p = (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.fma(p, 4194304.0, a), p, inside


@triton.jit
def sum_to_mag(t, p):
    """fp32 bits (int32) of the grid point of ``rne_sum``'s t: t - C, exact."""
    return tl.fma(p, -4194304.0, t).to(tl.int32, bitcast=True)


@triton.jit
def sum_to_index(t, p):
    """E2M1 magnitude index (int32 0..7) of ``rne_sum``'s t: steps above C (bits(t) - bits(C)), plus 2e
    (bits(C) = bits(p) + (22 << 23), bits(p) >> 22 = 2e + 254)."""
    pb = p.to(tl.int32, bitcast=True)
    return t.to(tl.int32, bitcast=True) - pb + (pb >> 22) - 0x0B0000FE


@triton.jit
def _half(x, s3, den3, rb3, FAST_DIV: tl.constexpr):
    """``rne_sum`` of z = x * S_enc / sf for one element of each pair (fp32 x [BM, NBT, P]); rb3 = 0 where sf = 0."""
    a = x * s3
    if FAST_DIV:
        z = f.markstein(a, -den3, rb3)  # +-0 where rb3 = 0
    else:
        z = tl.where(rb3 != 0.0, tl.div_rn(a, den3), 0.0)
    return rne_sum(z)


@triton.jit
def store_bits(il, ih, bits_ptr, rows, rmask, blk, bmask, NB, P: tl.constexpr, NBT: tl.constexpr):
    """The record's mantissa bits (index bit 0), 8 elements per byte, from the indices of a pair tile."""
    mb = ((il & 1) | ((ih & 1) << 1)) << (2 * (tl.arange(0, P) % 4))[None, None, :]
    b = tl.sum(mb.reshape(il.shape[0], NBT, P // 4, 4), axis=3)
    boff = rows[:, None, None] * (NB * P // 4) + blk[:, :, None] * (P // 4) + tl.arange(0, P // 4)[None, None, :]
    tl.store(bits_ptr + boff, b.to(tl.uint8), mask=rmask[:, None, None] & bmask[:, :, None])


@triton.jit
def _store_code_words(il, ih, w, ok, orows, rows, rmask, blk, bmask, NB, codes_ptr, bits_ptr, P: tl.constexpr,
                      WRITE_CODES: tl.constexpr, WRITE_BITS: tl.constexpr, HW: tl.constexpr):
    """Codes as int32 words of 8 (rows ``orows``) and the record's mantissa bits (bit 0 of each code: one byte
    per code word, rows ``rows``) of a bf16 pair tile."""
    f.store_code_words(f.code_words(il, ih, w, ok, HW), orows, rows, rmask, blk, bmask, NB, codes_ptr, bits_ptr, P,
                       WRITE_CODES, WRITE_BITS)


@triton.jit
def _store_deq(w, kt, rmask, lo, hi, ml, mh, ok, sf, s3, rows, NB, deq_ptr, XDT: tl.constexpr, P: tl.constexpr,
               NBT: tl.constexpr, FAST_DIV: tl.constexpr, HW: tl.constexpr):
    """Dequantized pairs from the grid points' bits ml, mh (``quant_guided_triton.deq_mag``), x's signs."""
    d1, d3 = qg._block_consts(sf, s3, FAST_DIV, XDT == 0, HW)
    nan = (sf != sf)[:, :, None]  # an all-NaN block (unchecked): NaN out, as the index path (bf16 rounding of
    d1, d3 = tl.where(nan, float("nan"), d1), tl.where(nan, float("nan"), d3)  # a NaN may give -0)
    dd = (d3 - d1) * 2.0
    vl = qg.deq_mag(ml.to(tl.float32, bitcast=True), d1, dd)
    vh = qg.deq_mag(mh.to(tl.float32, bitcast=True), d1, dd)
    if XDT == 0:  # bf16 pair: the high halves, the signs of x's word (+0 where the block scale is 0)
        smask = tl.where(ok, -2147450880, 0)[:, :, None]  # 0x80008000: both sign bits
        word = f.high_halves(vl, vh, HW) | (w.to(tl.int32, bitcast=True) & smask)
        f.store_words(deq_ptr, rows, rmask, kt, NB * P, word.to(deq_ptr.dtype.element_ty, bitcast=True),
                      NBT, P, False)
    else:  # fp32 pair (uint64 word)
        smask = tl.where(ok, -2147483648, 0)[:, :, None]  # 0x80000000
        sl = lo.to(tl.int32, bitcast=True) & smask
        sh = hi.to(tl.int32, bitcast=True) & smask
        words = f.pair((vl | sl).to(tl.float32, bitcast=True), (vh | sh).to(tl.float32, bitcast=True), 2, True)
        f.store_words(deq_ptr, rows, rmask, kt, NB * P, words.to(deq_ptr.dtype.element_ty, bitcast=True),
                      NBT, P, False)


@triton.jit
def rne_tile(w, wcol, m3, amax_b, kt, rows, orows, rmask, NB, s_b, codes_ptr, scales_ptr, bits_ptr, deq_ptr, mask_ptr,
             XDT: tl.constexpr, P: tl.constexpr, NBT: tl.constexpr, WRITE_CODES: tl.constexpr,
             WRITE_SCALES: tl.constexpr, WRITE_BITS: tl.constexpr, WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr,
             FAST_DIV: tl.constexpr, HW: tl.constexpr):
    """``quant_pair_triton._pair_tile`` for RNE NVFP4 with bf16 or fp32 x (see the module docstring); codes and
    scales go to rows ``orows``, the other outputs to ``rows``. HW: the block scales by the GPU's conversions
    (``triton_fp4.nvfp4_block_scale_hw``) and reciprocal."""
    lo, hi = f.unpair(w, XDT)
    blk = kt * NBT + tl.arange(0, NBT)[None, :]
    bmask = blk < NB
    if HW and FAST_DIV:
        sf, byte = f.nvfp4_block_scale_hw(amax_b, s_b)  # [BM, NBT]
    else:
        sf, byte = f.nvfp4_block_scale(amax_b, s_b)
    ok = sf > 0.0
    den = tl.where(ok, sf, 1.0)
    rb3 = tl.where(ok, f.recip_rn(den, HW), 0.0)[:, :, None]
    s3 = s_b[:, :, None]
    t_lo, p_lo, in_lo = _half(lo, s3, den[:, :, None], rb3, FAST_DIV)
    t_hi, p_hi, in_hi = _half(hi, s3, den[:, :, None], rb3, FAST_DIV)
    if WRITE_CODES or WRITE_BITS:
        il, ih = sum_to_index(t_lo, p_lo), sum_to_index(t_hi, p_hi)
        if XDT == 0:  # bf16: whole code words (``triton_fp4.code_words``), the record's bits from them
            _store_code_words(il, ih, w, ok, orows, rows, rmask, blk, bmask, NB, codes_ptr, bits_ptr, P, WRITE_CODES,
                              WRITE_BITS, HW)
        elif WRITE_CODES:
            sgn = tl.where(ok, 8, 0)[:, :, None]  # z = +0 where the block scale is 0
            cl = il | ((lo.to(tl.int32, bitcast=True) >> 28) & sgn)
            ch = ih | ((hi.to(tl.int32, bitcast=True) >> 28) & sgn)
            woff = orows[:, None, None] * (NB * P) + blk[:, :, None] * P + tl.arange(0, P)[None, None, :]
            tl.store(codes_ptr + woff, (cl | (ch << 4)).to(tl.uint8), mask=m3)
        if WRITE_BITS and XDT != 0:
            store_bits(il, ih, bits_ptr, rows, rmask, blk, bmask, NB, P, NBT)
    if WRITE_SCALES:  # (by the GPU's byte stores: a thread's blocks are not adjacent when it holds several)
        f.store_u8(scales_ptr + orows[:, None] * NB + blk, byte, rmask[:, None] & bmask, HW)
    if WRITE_DEQ:
        ml, mh = sum_to_mag(t_lo, p_lo), sum_to_mag(t_hi, p_hi)
        _store_deq(w, kt, rmask, lo, hi, ml, mh, ok, sf, s3, rows, NB, deq_ptr, XDT, P, NBT, FAST_DIV, HW)
    if WRITE_MASK:
        mk = in_lo.to(tl.uint16) | (in_hi.to(tl.uint16) << 8)  # |z| <= 6
        f.store_words(mask_ptr, rows, rmask, kt, NB * P, mk.to(tl.int16, bitcast=True), NBT, P, False)
