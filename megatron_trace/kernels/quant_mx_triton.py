"""MXFP4 RNE quantize of bf16 rows by packed bf16 pairs: the pair kernel's tile for MXFP4 codes (and the record's
bits) of bf16 x, without a dequantized output or STE mask (``pair_launch._by_magnitude``).

``quant_pair_triton._pair_tile`` unpacks each word of two bf16 elements to fp32 and finds each element's E2M1
index (``triton_fp4.rne_index``: about seven ALU-pipe instructions per element). Here both halves of a word go
through each step at once (one instruction per pair), in bf16 arithmetic:

- z = x * 2**-e by one ``mul.rn.bf16x2`` with the block's power of two in both halves. It is exact where it
  matters: a bf16 significand times a power of two, unless the product is below 2**-126, and such a |z| rounds
  to the index 0 either way (the signs come from x's words).
- |z| plus C = 64, 128 or 256 (for |z| below 2, below 4, from 4 on; 512 past 8, which saturates) by one
  ``add.rn.bf16x2``: bf16's 7 fraction bits make C's step 0.5, 1 or 2, the E2M1 grid's step in that binade, so the
  sum is C plus |z| rounded to the grid, ties to even (the reference's RNE), and its bits count grid steps. C comes
  from |z|'s exponent field clamped per half (``min.u16x2`` / ``max.u16x2``).
- The index is bits(sum) - bits(C) + bits(C) / 64 - 266 per half (no borrow crosses the halves), at most 7; the
  two codes of a pair (with x's sign bits) become one byte, and four bytes one code word (byte permutes).

In Triton's CPU interpreter the packed instructions are emulated per half: the fp32 sum or product rounded to bf16
by bits is the packed instruction's result here (the fp32 step is exact or far from a bf16 tie).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import triton_fp4 as f


@triton.jit
def _halves(a):
    """The two bf16 halves of uint32 words as fp32."""
    return (a << 16).to(tl.float32, bitcast=True), (a & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _packed(lo, hi):
    """fp32 (lo, hi), each rounded to bf16 by bits (RNE), as one uint32 word."""
    rl = f.rne_bf16(lo).to(tl.uint32, bitcast=True)
    rh = f.rne_bf16(hi).to(tl.uint32, bitcast=True)
    return (rl >> 16) | (rh & 0xFFFF0000)


@triton.jit
def bf16x2_mul(a, b, HW: tl.constexpr):
    """``mul.rn.bf16x2`` of uint32 words (HW: one instruction; else per half, for finite products)."""
    if HW:
        return f.asm2("mul.rn.bf16x2 $0, $1, $2;", a, b)
    else:
        al, ah = _halves(a)
        bl, bh = _halves(b)
        return _packed(al * bl, ah * bh)


@triton.jit
def bf16x2_add(a, b, HW: tl.constexpr):
    """``add.rn.bf16x2`` of uint32 words (HW: one instruction; else per half, for finite sums)."""
    if HW:
        return f.asm2("add.rn.bf16x2 $0, $1, $2;", a, b)
    else:
        al, ah = _halves(a)
        bl, bh = _halves(b)
        return _packed(al + bl, ah + bh)


@triton.jit
def u16x2_limit(a, b, MAX: tl.constexpr, HW: tl.constexpr):
    """``max.u16x2`` (MAX) or ``min.u16x2``: the unsigned maximum / minimum of each 16-bit half of uint32 words."""
    if HW:
        if MAX:
            return f.asm2("max.u16x2 $0, $1, $2;", a, b)
        else:
            return f.asm2("min.u16x2 $0, $1, $2;", a, b)
    else:
        b = b + tl.zeros_like(a)
        if MAX:
            return tl.maximum(a & 0xFFFF, b & 0xFFFF) | (tl.maximum(a >> 16, b >> 16) << 16)
        else:
            return tl.minimum(a & 0xFFFF, b & 0xFFFF) | (tl.minimum(a >> 16, b >> 16) << 16)


@triton.jit
def pair_indices(w, e, HW: tl.constexpr):
    """E2M1 magnitude indices of RNE(|x| * 2**-e) for the bf16 pairs w (uint32 [BM, NBT, P]) and the blocks'
    exponents e (int32 [BM, NBT]): the even element's index at bits 0-2, the odd one's at bits 16-18 (uint32)."""
    n = -e
    s = tl.where(n >= -126, (n + 127) << 7, 0x0040).to(tl.uint32)  # bf16 bits of 2**-e (2**-127: a subnormal)
    z = bf16x2_mul(w, (s * 0x00010001)[:, :, None], HW)
    a = z & 0x7FFF7FFF
    c = u16x2_limit(u16x2_limit(a & 0x7F807F80, 0x3F803F80, True, HW), 0x41004100, False, HW) + 0x03000300  # C
    t = bf16x2_add(a, c, HW)
    return u16x2_limit(t - c + ((c >> 6) & 0x03FF03FF) - 0x010A010A, 0x00070007, False, HW)


@triton.jit
def code_words(w, e, HW: tl.constexpr):
    """MXFP4 code words (int32 [BM, NBT, P // 4]: 8 codes each, code 8c + j at bits 4j) of the bf16 pairs w."""
    v = pair_indices(w, e, HW) | ((w >> 12) & 0x00080008)  # the sign bits 15, 31 under each index
    b = v | (v >> 12)  # byte 0: the pair's code byte (even code low, odd code high)
    b0, b1, b2, b3 = f.split4(b)
    return f.prmt(f.prmt(b0, b1, 0x0040, HW), f.prmt(b2, b3, 0x0040, HW), 0x5410, HW).to(tl.int32, bitcast=True)


@triton.jit
def mx_rne_tile(w, amax_b, kt, rows, orows, rmask, NB, codes_ptr, scales_ptr, bits_ptr, FMT: tl.constexpr,
                P: tl.constexpr, NBT: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_SCALES: tl.constexpr,
                WRITE_BITS: tl.constexpr, HW: tl.constexpr):
    """MXFP4 RNE codes, E8M0 scales and record bits of a tile of bf16 pairs w [BM, NBT, P] held as whole blocks per
    thread (block amaxes amax_b [BM, NBT]); codes and scales go to rows ``orows``."""
    blk = kt * NBT + tl.arange(0, NBT)[None, :]
    bmask = blk < NB
    e = f.mx_exponent(amax_b, FMT)
    f.store_code_words(code_words(w, e, HW), orows, rows, rmask, blk, bmask, NB, codes_ptr, bits_ptr, P,
                       WRITE_CODES, WRITE_BITS)
    if WRITE_SCALES:
        f.store_u8(scales_ptr + orows[:, None] * NB + blk, (e + 127).to(tl.int32), rmask[:, None] & bmask, HW)
