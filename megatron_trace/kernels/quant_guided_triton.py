"""Guided NVFP4 rounding of element pairs by magnitudes: the pair kernel's tiles for ``GUIDED_COMPACT`` and
``GUIDED_FULL`` (``guided_full_tile``: the same sums, the rollout's code picks between them).

The trainer's fake-quant forward rounds toward the rollout's mantissa bits. ``quant_pair_triton._pair_tile`` finds
an E2M1 index per element (``triton_fp4.compact_index``) and dequantizes it with a multiply and a division per
element. This tile works on the fp32 value of the chosen grid point instead (same results, bit for bit):

- Rounding on the GPU (``toward_bit_hw``): a = min(|z|, 6) plus C = 2**22 times a's binade (0.5 below 2, then 1,
  2), rounded down and up (two directed fp32 additions), is C plus the grid points below and above a; bit 0 of
  the sum is the point's mantissa bit, so the record picks one of the two sums. In Triton's CPU interpreter, which
  has no directed rounding, ``toward_bit`` does the same on the bits u of a: the point at or below u is u with its
  low mantissa bits cleared (22 from 1.0 up, 23 in [0.5, 1)); adding ``~mask`` first gives the point above.
  Below 0.5 the point is 0.5 when the record's bit is 1 and z != 0, else 0; z != 0 comes from |x * S_enc|
  against sf * 2**-150 rounded down (a subnormal whose bits are floor(sf / 2)), exactly, so tiny quotients need no
  IEEE division.
- Dequantization (``deq_mag``): every grid value is 2**k or 1.5 * 2**k, so ``value * sf / S_enc`` rounded is 2**k
  times d1 = RN(sf / S_enc) or d3 = RN(1.5 sf / S_enc), exactly (both normal in the fast path's S_enc range):
  two divisions per block, three exact fp32 operations per element. For bf16 output d1, d3 are rounded to bf16
  first (scaling by 2**k commutes with that rounding too), so the bf16 word is the high halves of the two
  products, and the sign comes from x's word.
- Layout: the tile is read as whole blocks per thread (``triton_fp4.load_words``), and on the GPU the block
  scales and record bits (16 per block) are loaded by ``triton_fp4.load_nc`` in the layout of their use: no
  shared-memory exchange, and each block's constants are computed once.
Most of these choices move work from the ALU pipe (half the FMA pipes' rate on sm_90) to the FMA pipes.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

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
def _directed_sums(z, nz):
    """(t_dn, t_up, c, bits of c) of ``toward_bit_hw``: a = min(|z|, 6) plus C rounded down and up."""
    ab = tl.where(nz, tl.maximum(tl.minimum(tl.abs(z), 6.0).to(tl.int32, bitcast=True), 0x800000), 0)  # bits of a
    a = ab.to(tl.float32, bitcast=True)
    cb = tl.maximum(ab & 0x7F800000, _ONE) + 0x0B000000
    c = cb.to(tl.float32, bitcast=True)
    return libdevice.add_rd(a, c), libdevice.add_ru(a, c), c, cb


@triton.jit
def toward_bit_hw(z, g16, j, nz):
    """``toward_bit`` on the GPU by two directed roundings (fp32 magnitude out, z: the quotient; the record's bit:
    bit j of g16; nz: z != 0).

    a = min(|z|, 6) (NaN -> 6; at least 2**-126 where z != 0, since Triton's libdevice flushes subnormals; 0 where
    z = 0) plus C = p * 2**22 (p = 2**e, e = max(floor(log2 a), 0), as in ``quant_rne_triton.rne_sum``), rounded
    down and up, is C plus the grid points below and above a, counted in grid steps. A grid point's mantissa bit
    is the parity of its count (0.5: 1), which is bit 0 of the sum's bits: the sum whose bit 0 is the record's
    bit is the one rounded toward. The sum's bit 0 is moved to the record bit's place j (one shift, none for
    j = 0), not each record bit to a common place."""
    t_dn, t_up, c, _ = _directed_sums(z, nz)
    up = (((t_dn.to(tl.int32, bitcast=True) << j) ^ g16) & (1 << j)) != 0
    return tl.where(up, t_up, t_dn) - c


@triton.jit
def toward_code(u, key, nz):
    """fp32 bits (int32) of the E2M1 magnitude that ``rounding.guided_full`` picks for u = bits of min(|z|, 6): the
    point above u when the rollout's code has z's sign and a larger magnitude index than the point below (only
    then is the point above the nearer), else the point below. key: 8 + the rollout's index where the signs agree,
    else its index (``guided_full_tile``), so one comparison with the index below + 8 decides; nz: z != 0 (int1)."""
    nmask = tl.where(u >= _ONE, 0x3FFFFF, 0x7FFFFF)  # bits below the grid step, as in ``toward_bit``
    small = u < _HALF
    dn = tl.where(small, 0, u & ~nmask)
    up = tl.where(small, tl.where(nz, _HALF, 0), (u + nmask) & ~nmask)
    return tl.where(key > mag_to_index(dn) + 8, up, dn)


@triton.jit
def toward_code_hw(z, key, nz):
    """``toward_code`` on the GPU (fp32 magnitude out, z: the quotient): the directed sums of ``toward_bit_hw``;
    the index of the point below is the sum's count of grid steps above C plus C's first index,
    bits(t_dn) - bits(C) + (bits(C) >> 22) - 298 (C = 2**22, 2**23, 2**24: first index 0, 4, 6)."""
    t_dn, t_up, c, cb = _directed_sums(z, nz)
    fl8 = t_dn.to(tl.int32, bitcast=True) - cb + (cb >> 22) - 290  # the index below + 8
    return tl.where(key > fl8, t_up, t_dn) - c


@triton.jit
def _quotient(x, s3, den3, rb3, nz_thr, FAST_DIV: tl.constexpr):
    """(z = x * S_enc / sf, z != 0 exactly) for fp32 x [BM, NBT, P]; rb3 = 0 where sf = 0 (z = 0)."""
    a = x * s3
    if FAST_DIV:
        z = f.markstein(a, -den3, rb3)  # +-0 where rb3 = 0
    else:
        z = tl.where(rb3 != 0.0, tl.div_rn(a, den3), 0.0)
    return z, ~(tl.abs(a) <= nz_thr)  # |a| > RD(sf * 2**-150): RN(a / sf) != 0 (or NaN)


@triton.jit
def _half(x, s3, den3, rb3, g16, j, nz_thr, FAST_DIV: tl.constexpr, HW: tl.constexpr):
    """(magnitude as fp32, |z| <= 6) of one element of each pair (fp32 x [BM, NBT, P]); rb3 = 0 where sf = 0; the
    record's bit of each element: bit j of g16."""
    z, nz = _quotient(x, s3, den3, rb3, nz_thr, FAST_DIV)
    if HW:
        m = toward_bit_hw(z, g16, j, nz)
        inside = tl.abs(z) <= 6.0
    else:
        za = z.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        m = toward_bit(tl.minimum(za, _MAG_6), g16 << (22 - j), nz).to(tl.float32, bitcast=True)
        inside = za <= _MAG_6
    return m, inside


@triton.jit
def _half_full(x, s3, den3, rb3, key, nz_thr, FAST_DIV: tl.constexpr, HW: tl.constexpr):
    """(magnitude as fp32, |z| <= 6) of one element of each pair for full guidance (key: ``toward_code``'s)."""
    z, nz = _quotient(x, s3, den3, rb3, nz_thr, FAST_DIV)
    if HW:
        m = toward_code_hw(z, key, nz)
        inside = tl.abs(z) <= 6.0
    else:
        za = z.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        m = toward_code(tl.minimum(za, _MAG_6), key, nz).to(tl.float32, bitcast=True)
        inside = za <= _MAG_6
    return m, inside


@triton.jit
def deq_mag(m, d1, dd):
    """fp32 bits (int32) of the dequantized grid magnitude m = 2**k or 1.5 * 2**k (or 0): 2**k * d1 or 2**k * d3,
    as p2 * d1 + (m - p2) * dd with p2 = 2**k and dd = 2 (d3 - d1) (exact, as d1 <= d3 <= 2 d1). Every step is
    exact, and they run on the FMA pipes, not on the ALU (the selection of d1 or d3 would)."""
    p2 = (m.to(tl.int32, bitcast=True) & -0x800000).to(tl.float32, bitcast=True)
    return tl.fma(m - p2, dd, p2 * d1).to(tl.int32, bitcast=True)


@triton.jit
def _block_consts(sf, s3, FAST_DIV: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr):
    """Per block [BM, NBT, 1]: d1 = RN(sf / S_enc), d3 = RN(1.5 sf / S_enc) (rounded to bf16 if BF16; by the GPU's
    conversion if HW)."""
    sf3 = sf[:, :, None]
    if FAST_DIV:
        re = tl.div_rn(tl.full(s3.shape, 1.0, tl.float32), s3)
        d1, d3 = f.markstein(sf3, -s3, re), f.markstein(sf3 * 1.5, -s3, re)
    else:
        d1, d3 = tl.div_rn(sf3, s3), tl.div_rn(sf3 * 1.5, s3)
    if BF16:  # RNE to bf16 precision (positive, finite)
        d1, d3 = f.bf16_rne_pair(d1, d3, HW)
    return d1, d3


@triton.jit
def guided_loads(rows, rmask, kt, NB, gc_ptr, s_in_ptr, NBT: tl.constexpr, FULL: tl.constexpr, HW: tl.constexpr):
    """The record's block scale bytes and, per block, its 16 mantissa bits (int32) or, FULL, its 16 codes (the
    block's 8 code bytes as one int64) of blocks [kt*NBT, (kt+1)*NBT), as [BM, NBT] each (0 out of bounds): the
    guided tiles' inputs, loaded apart so that a caller can issue them ahead (``quant_pair_triton``'s prefetching
    loop). On the GPU ``triton_fp4.load_nc`` lays them out as their users are: no shared-memory exchange."""
    blk = kt * NBT + tl.arange(0, NBT)[None, :]
    bm2 = rmask[:, None] & (blk < NB)
    sidx = rows[:, None] * NB + blk
    if HW:
        sfb = f.load_nc(s_in_ptr + sidx, bm2, 8)
    else:
        sfb = tl.load(s_in_ptr + sidx, mask=bm2, other=0).to(tl.int32)
    if FULL:
        cptr = (gc_ptr + sidx * 8).to(tl.pointer_type(tl.int64))
        g = f.load_nc(cptr, bm2, 64) if HW else tl.load(cptr, mask=bm2, other=0)
    elif HW:
        g = f.load_nc(gc_ptr + sidx * 2, bm2, 16)
    else:
        g = (tl.load(gc_ptr + sidx * 2, mask=bm2, other=0).to(tl.int32)
             | (tl.load(gc_ptr + sidx * 2 + 1, mask=bm2, other=0).to(tl.int32) << 8))
    return sfb, g


@triton.jit
def _block_setup(sfb, HW: tl.constexpr):
    """Per block [BM, NBT] from the record's scale bytes: sf, sf > 0, and as [BM, NBT, 1] the divisor (1 where
    sf = 0), RN(1 / sf) (0 where sf = 0) and RD(sf * 2**-150) (+Inf where sf = 0: z = 0)."""
    if HW:  # the GPU's E4M3 conversion
        sf = sfb.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        sf = f.e4m3_value(sfb)
    ok = sf > 0.0
    den = tl.where(ok, sf, 1.0)
    rb3 = tl.where(ok, f.recip_rn(den, HW), 0.0)[:, :, None]
    # RD(sf * 2**-150), a subnormal: its bits are floor(sf / 2) (a multiple of 2**-149 exceeds sf * 2**-150 just
    # when it exceeds that)
    nz_thr = tl.where(ok, (sf * 0.5).to(tl.int32).to(tl.float32, bitcast=True), float("inf"))[:, :, None]
    return sf, ok, den[:, :, None], rb3, nz_thr


@triton.jit
def _outputs(ml, mh, in_l, in_h, nl, nh, sw, w, sf, s3, kt, rows, rmask, m3, blk, NB, codes_ptr, deq_ptr, mask_ptr,
             XDT: tl.constexpr, P: tl.constexpr, NBT: tl.constexpr, WRITE_CODES: tl.constexpr,
             WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, FAST_DIV: tl.constexpr, HW: tl.constexpr):
    """The guided tiles' outputs from the chosen magnitudes ml, mh (fp32) of a pair tile: codes (signs nl, nh: 8
    or 0), the dequantized words (bf16 pairs: signs sw at bits 15 and 31, None: x's words', +0 where the block
    scale is 0; fp32: nl, nh) and the STE mask."""
    p = tl.arange(0, P)[None, None, :]
    woff = rows[:, None, None] * (NB * P) + blk[:, :, None] * P + p
    if WRITE_CODES and XDT == 0:  # whole code words of 8, the signs from words (x's, or sw for full guidance)
        il, ih = mag_to_index(ml.to(tl.int32, bitcast=True)), mag_to_index(mh.to(tl.int32, bitcast=True))
        if sw is None:
            iw = f.code_words(il, ih, w, sf > 0.0, HW)
        else:
            iw = f.code_words(il, ih, sw.to(tl.uint32, bitcast=True), sf == sf, HW)
        f.store_code_words(iw, rows, rows, rmask, blk, blk < NB, NB, codes_ptr, codes_ptr, P, True, False)
    elif WRITE_CODES:
        cl = mag_to_index(ml.to(tl.int32, bitcast=True)) | nl
        ch = mag_to_index(mh.to(tl.int32, bitcast=True)) | nh
        tl.store(codes_ptr + woff, (cl | (ch << 4)).to(tl.uint8), mask=m3)
    if WRITE_DEQ:
        d1, d3 = _block_consts(sf, s3, FAST_DIV, XDT == 0, HW)
        dd = (d3 - d1) * 2.0
        vl, vh = deq_mag(ml, d1, dd), deq_mag(mh, d1, dd)
        if XDT == 0:  # bf16 pair: the high halves and the signs
            if sw is None:
                sw = w.to(tl.int32, bitcast=True) & tl.where(sf > 0.0, -2147450880, 0)[:, :, None]
            word = f.high_halves(vl, vh, HW) | sw
        else:  # fp32 pair (uint64 word)
            sl, sh = (vl | (nl << 28)).to(tl.float32, bitcast=True), (vh | (nh << 28)).to(tl.float32, bitcast=True)
            word = f.pair(sl, sh, 2, True)
        f.store_words(deq_ptr, rows, rmask, kt, NB * P, word.to(deq_ptr.dtype.element_ty, bitcast=True), NBT, P,
                      True)
    if WRITE_MASK:
        mk = in_l.to(tl.uint16) | (in_h.to(tl.uint16) << 8)
        f.store_words(mask_ptr, rows, rmask, kt, NB * P, mk.to(tl.int16, bitcast=True), NBT, P, True)


@triton.jit
def guided_compact_tile(w, wcol, m3, kt, rows, rmask, NB, s_b, sfb, g16, codes_ptr, deq_ptr, mask_ptr,
                        XDT: tl.constexpr, P: tl.constexpr, NBT: tl.constexpr, WRITE_CODES: tl.constexpr,
                        WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, FAST_DIV: tl.constexpr,
                        HW: tl.constexpr):
    """``quant_pair_triton._pair_tile`` for GUIDED_COMPACT NVFP4 with bf16 or fp32 x (see the module docstring);
    sfb, g16: ``guided_loads`` of the same blocks. Signs are x's (+0 where the block scale is 0)."""
    lo, hi = f.unpair(w, XDT)
    blk = kt * NBT + tl.arange(0, NBT)[None, :]
    sf, ok, den3, rb3, nz_thr = _block_setup(sfb, HW)
    p = tl.arange(0, P)[None, None, :]
    s3 = s_b[:, :, None]
    ml, in_l = _half(lo, s3, den3, rb3, g16[:, :, None], 2 * p, nz_thr, FAST_DIV, HW)
    mh, in_h = _half(hi, s3, den3, rb3, g16[:, :, None], 2 * p + 1, nz_thr, FAST_DIV, HW)
    sgn = tl.where(ok, 8, 0)[:, :, None]
    nl = (lo.to(tl.int32, bitcast=True) >> 28) & sgn
    nh = (hi.to(tl.int32, bitcast=True) >> 28) & sgn
    _outputs(ml, mh, in_l, in_h, nl, nh, None, w, sf, s3, kt, rows, rmask, m3, blk, NB, codes_ptr, deq_ptr, mask_ptr,
             XDT, P, NBT, WRITE_CODES, WRITE_DEQ, WRITE_MASK, FAST_DIV, HW)


@triton.jit
def guided_full_tile(w, wcol, m3, kt, rows, rmask, NB, s_b, sfb, g64, codes_ptr, deq_ptr, mask_ptr,
                     XDT: tl.constexpr, P: tl.constexpr, NBT: tl.constexpr, WRITE_CODES: tl.constexpr,
                     WRITE_DEQ: tl.constexpr, WRITE_MASK: tl.constexpr, FAST_DIV: tl.constexpr, HW: tl.constexpr):
    """``guided_compact_tile`` for GUIDED_FULL: sfb, g64 (a block's 8 code bytes, byte i = codes 2i, 2i + 1 in
    its low, high nibble): ``guided_loads(FULL)`` of the same blocks; the picks of ``toward_code``.

    Signs: x's, except that a zero result takes the rollout's sign where the rollout's code is a zero too
    (``rounding.guided_full`` keeps the rollout's code). For bf16 x both come from words: the pair's code byte
    times 0x01001000 puts the two codes at bits 12-15 and 28-31, under the bf16 signs of x's word."""
    lo, hi = f.unpair(w, XDT)
    blk = kt * NBT + tl.arange(0, NBT)[None, :]
    sf, ok, den3, rb3, nz_thr = _block_setup(sfb, HW)
    p = tl.arange(0, P)[None, None, :]
    s3 = s_b[:, :, None]
    g3 = g64[:, :, None]
    r = (tl.where(p < 4, g3, g3 >> 32).to(tl.int32) >> (8 * (p % 4))) & 0xFF  # the pair's code byte
    if XDT == 0:
        rw = r.to(tl.uint32) * 0x01001000  # codes at bits 12-15 (even element), 28-31 (odd)
        sbits = tl.full([1, 1, 1], 0x80008000, tl.uint32)
        agree = rw ^ (w & sbits) ^ sbits  # the codes, with bits 15, 31 set where the code's sign is x's
        key_l, key_h = ((agree >> 12) & 15).to(tl.int32), (agree >> 28).to(tl.int32)
    else:
        xl = (lo.to(tl.int32, bitcast=True) >> 28) & 8
        xh = (hi.to(tl.int32, bitcast=True) >> 28) & 8
        key_l, key_h = (r ^ xl ^ 8) & 15, ((r >> 4) ^ xh ^ 8) & 15
    ml, in_l = _half_full(lo, s3, den3, rb3, key_l, nz_thr, FAST_DIV, HW)
    mh, in_h = _half_full(hi, s3, den3, rb3, key_h, nz_thr, FAST_DIV, HW)
    if XDT == 0:
        # bits 15, 31 of t: the result is not a zero under a rollout zero (its magnitude or the code's index is
        # nonzero: 15-bit halves plus 0x7FFF carry into bit 15 / 31), so the sign is x's (+0 where sf = 0)
        t = (f.high_halves(ml.to(tl.int32, bitcast=True), mh.to(tl.int32, bitcast=True), HW)
             | (rw & 0x70007000).to(tl.int32, bitcast=True)) + 0x7FFF7FFF
        xs = w.to(tl.int32, bitcast=True) & tl.where(ok, -2147450880, 0)[:, :, None]  # x's signs (0x80008000)
        sw = ((xs & t) | (rw.to(tl.int32, bitcast=True) & ~t)) & -2147450880
        nl, nh = (sw >> 12) & 8, (sw >> 28) & 8
    else:
        sgn = tl.where(ok, 8, 0)[:, :, None]
        nl = tl.where((ml == 0.0) & ((key_l & 7) == 0), r & 8, xl & sgn)
        nh = tl.where((mh == 0.0) & ((key_h & 7) == 0), (r >> 4) & 8, xh & sgn)
        sw = 0
    _outputs(ml, mh, in_l, in_h, nl, nh, sw, w, sf, s3, kt, rows, rmask, m3, blk, NB, codes_ptr, deq_ptr, mask_ptr,
             XDT, P, NBT, WRITE_CODES, WRITE_DEQ, WRITE_MASK, FAST_DIV, HW)
