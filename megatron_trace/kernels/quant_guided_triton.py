"""Guided compact NVFP4 rounding of element pairs by magnitudes: the pair kernel's tile for ``GUIDED_COMPACT``.

The trainer's fake-quant forward rounds toward the rollout's mantissa bits. ``quant_pair_triton._pair_tile`` finds
an E2M1 index per element (``triton_fp4.compact_index``) and dequantizes it with a multiply and a division per
element. This tile works on the fp32 bits of the chosen grid point instead (same results, bit for bit):

- ``toward_bit``: with u = the bits of min(|z|, 6), the grid point at or below u is u with its low mantissa bits
  cleared (22 from 1.0 up, 23 in [0.5, 1)); adding ``~mask`` first gives the point above. Which one is the
  point whose mantissa bit is the record's: one xor on bit 22. Below 0.5 the point is 0.5 when the record's bit
  is 1 and z != 0, else 0; z != 0 comes from |x * S_enc| against sf * 2**-150, exactly, so tiny quotients need
  no IEEE division.
- Dequantization: every grid value is 2**k or 1.5 * 2**k, so ``value * sf / S_enc`` rounded is 2**k times
  d1 = RN(sf / S_enc) or d3 = RN(1.5 sf / S_enc), exactly (both normal in the fast path's S_enc range): two
  divisions per block, one multiply per element. For bf16 output d1, d3 are rounded to bf16 first (scaling by
  2**k commutes with that rounding too), so the bf16 word is the high halves of the two products, and the sign
  comes from x's word.
Record bits are read per block as 16 bits (two bytes), each word shifts its two bits to bit 22.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import triton_fp4 as f

_MAG_6 = tl.constexpr(0x40C00000)  # bits of 6.0
_ONE = tl.constexpr(0x3F800000)
_HALF = tl.constexpr(0x3F000000)


@triton.jit
def toward_bit(u, b22, nz):
    """fp32 bits (int32) of the E2M1 magnitude that ``rounding.guided_compact`` picks for u = bits of min(|z|, 6);
    b22: the record's mantissa bit at bit 22 (other bits ignored); nz: z != 0 (int1)."""
    big = u >= _ONE
    nmask = tl.where(big, 0x3FFFFF, 0x7FFFFF)  # bits below the grid step: 0.5 from 1.0 up, 0.5 in [0.5, 1)
    par = u | (nmask & 0x400000)  # the floor point's mantissa bit at bit 22 (the point 0.5 has bit 1)
    up = ((par ^ b22) >> 22) & 1  # 1: the record's bit is the other point's
    m = (u + up * nmask) & ~nmask  # the floor point, or the point above if u is off the grid
    ms = tl.where(nz & ((b22 & 0x400000) != 0), _HALF, 0)
    return tl.where(u < _HALF, ms, m)


@triton.jit
def mag_to_index(m):
    """E2M1 magnitude index (int32 0..7) of the exact grid magnitude with fp32 bits m."""
    return tl.maximum((m >> 22) - 252, (m >> 29) & 1)  # 0.5: (m >> 22) - 252 = 0, m >> 29 = 1


@triton.jit
def _half(x, s3, den3, rb3, b22, nz_thr, FAST_DIV: tl.constexpr):
    """(magnitude bits, |z| bits) of one element of each pair (fp32 x [BM, NBT, P]); rb3 = 0 where sf = 0."""
    a = x * s3
    if FAST_DIV:
        z = f.markstein(a, -den3, rb3)  # +-0 where rb3 = 0
    else:
        z = tl.where(rb3 != 0.0, tl.div_rn(a, den3), 0.0)
    za = z.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    nz = tl.abs(a) * 1.2676506002282294e30 > nz_thr  # |a| * 2**100 > sf * 2**-50: RN(a / sf) != 0
    return toward_bit(tl.minimum(za, _MAG_6), b22, nz), za


@triton.jit
def _deq_bits(m, d1, d3):
    """fp32 bits of the dequantized magnitude: 2**k * d1 or 2**k * d3 for m = 2**k or 1.5 * 2**k (0 for 0)."""
    p2 = (m & -0x800000).to(tl.float32, bitcast=True)
    return (tl.where((m & 0x400000) != 0, d3, d1) * p2).to(tl.int32, bitcast=True)


@triton.jit
def rne_bf16(d):
    """fp32 d (positive, finite) rounded to bf16 precision, ties to even, by its bits (fp32 out)."""
    b = d.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _block_consts(sf, s3, FAST_DIV: tl.constexpr, BF16: tl.constexpr):
    """Per block [BM, NBT, 1]: d1 = RN(sf / S_enc), d3 = RN(1.5 sf / S_enc) (rounded to bf16 if BF16)."""
    sf3 = sf[:, :, None]
    if FAST_DIV:
        re = tl.div_rn(tl.full(s3.shape, 1.0, tl.float32), s3)
        d1, d3 = f.markstein(sf3, -s3, re), f.markstein(sf3 * 1.5, -s3, re)
    else:
        d1, d3 = tl.div_rn(sf3, s3), tl.div_rn(sf3 * 1.5, s3)
    if BF16:  # RNE to bf16 precision (positive, finite)
        d1, d3 = rne_bf16(d1), rne_bf16(d3)
    return d1, d3


@triton.jit
def guided_compact_tile(w, wcol, m3, kt, rows, rmask, NB, s_b, gc_ptr, codes_ptr, deq_ptr, mask_ptr, s_in_ptr,
                        XDT: tl.constexpr, P: tl.constexpr, NBT: tl.constexpr, WRITE_CODES: tl.constexpr,
                        WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, FAST_DIV: tl.constexpr):
    """``quant_pair_triton._pair_tile`` for GUIDED_COMPACT NVFP4 with bf16 or fp32 x (see the module docstring)."""
    lo, hi = f.unpair(w, XDT)
    blk = kt * NBT + tl.arange(0, NBT)[None, :]
    bm2 = rmask[:, None] & (blk < NB)
    sf = f.e4m3_value(tl.load(s_in_ptr + rows[:, None] * NB + blk, mask=bm2, other=0))  # [BM, NBT]
    ok = sf > 0.0
    den3 = tl.where(ok, sf, 1.0)[:, :, None]
    rb3 = tl.where(ok, tl.div_rn(tl.full(sf.shape, 1.0, tl.float32), tl.where(ok, sf, 1.0)), 0.0)[:, :, None]
    nz_thr = tl.where(ok, sf * 8.881784197001252e-16, float("inf"))[:, :, None]  # sf * 2**-50; sf = 0: z = 0
    gbase = gc_ptr + rows[:, None] * (NB * 2) + blk * 2
    g16 = (tl.load(gbase, mask=bm2, other=0).to(tl.int32)
           | (tl.load(gbase + 1, mask=bm2, other=0).to(tl.int32) << 8))[:, :, None]  # the block's 16 bits
    p = tl.arange(0, P)[None, None, :]
    s3 = s_b[:, :, None]
    ml, zl = _half(lo, s3, den3, rb3, g16 << (22 - 2 * p), nz_thr, FAST_DIV)
    mh, zh = _half(hi, s3, den3, rb3, g16 << (21 - 2 * p), nz_thr, FAST_DIV)
    woff = rows[:, None, None] * (NB * P) + blk[:, :, None] * P + p
    sgn = tl.where(ok, 8, 0)[:, :, None]
    if WRITE_CODES:
        cl = mag_to_index(ml) | ((lo.to(tl.int32, bitcast=True) >> 28) & sgn)
        ch = mag_to_index(mh) | ((hi.to(tl.int32, bitcast=True) >> 28) & sgn)
        tl.store(codes_ptr + woff, (cl | (ch << 4)).to(tl.uint8), mask=m3)
    if WRITE_DEQ:
        d1, d3 = _block_consts(sf, s3, FAST_DIV, XDT == 0)
        vl, vh = _deq_bits(ml, d1, d3), _deq_bits(mh, d1, d3)
        if XDT == 0:  # bf16 pair: the high halves, the signs of x's word (+0 where the block scale is 0)
            smask = tl.where(ok, -2147450880, 0)[:, :, None]  # 0x80008000: both sign bits
            word = ((vl >> 16) & 0xFFFF) | (vh & -65536) | (w.to(tl.int32, bitcast=True) & smask)
            tl.store(deq_ptr + rows[:, None, None] * (NB * P) + wcol, word.to(deq_ptr.dtype.element_ty, bitcast=True),
                     mask=m3)
        else:  # fp32 pair (uint64 word)
            sl = lo.to(tl.int32, bitcast=True) & (sgn << 28)
            sh = hi.to(tl.int32, bitcast=True) & (sgn << 28)
            words = f.pair((vl | sl).to(tl.float32, bitcast=True), (vh | sh).to(tl.float32, bitcast=True), 2, True)
            tl.store(deq_ptr + rows[:, None, None] * (NB * P) + wcol, words.to(deq_ptr.dtype.element_ty, bitcast=True),
                     mask=m3)
    if WRITE_MASK:
        mk = (zl <= _MAG_6).to(tl.uint16) | ((zh <= _MAG_6).to(tl.uint16) << 8)
        tl.store(mask_ptr + rows[:, None, None] * (NB * P) + wcol, mk.to(tl.int16, bitcast=True), mask=m3)
