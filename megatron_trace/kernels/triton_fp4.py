"""Triton device functions shared by the FP4 kernels: the bit-exact twins of ``formats`` primitives.

Every function reproduces the reference's fp32 operations in the same order with IEEE rounding
(``tl.div_rn`` for division, no FMA contraction: launch with ``enable_fp_fusion=False``), and builds
powers of two and E4M3 values from bit patterns, so results do not depend on the hardware's
conversion instructions (or on the CPU interpreter's emulation of them).
"""

from __future__ import annotations

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
"""The largest float32 (NVFP4's encode scale saturates here)."""

# Formats (constexpr selectors).
NVFP4 = tl.constexpr(0)
MXFP4_FLOOR = tl.constexpr(1)
MXFP4_CEIL = tl.constexpr(2)


@triton.jit
def signbit(v):
    """signbit of fp32 ``v`` as int1 (-0.0 counts as negative)."""
    return v.to(tl.int32, bitcast=True) < 0


@triton.jit
def e2m1_rne(z):
    """``e2m1.encode_rne``: fp32 -> uint8 codes (RNE with the reference's tie table, saturating).

    NaN (not reached from finite inputs since S_enc saturates at FLT_MAX) gives code 8, as the reference
    does on x86, whose invalid-operation NaN has the sign bit set.
    """
    a = tl.abs(z)
    idx = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    idx += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    idx += (a > 5.0).to(tl.int32)
    neg = signbit(z) | (z != z)
    return (idx | (neg.to(tl.int32) << 3)).to(tl.uint8)


@triton.jit
def e2m1_mag(idx):
    """E2M1 magnitude (fp32) of a 3-bit index (int32 0..7), built from its bit pattern."""
    bits = tl.where(idx >= 2, (idx << 22) + 0x3F000000, idx * 0x3F000000)  # 2^(e-1) * (1 + m/2); 0.5; 0
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_decode(code):
    """``e2m1.decode``: codes (any int type, 0..15) -> fp32 values; code 8 gives -0.0."""
    c = code.to(tl.int32)
    mag_bits = e2m1_mag(c & 7).to(tl.int32, bitcast=True)
    return (mag_bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)  # sign by bit: -0.0 stays -0.0


@triton.jit
def mag_index(a):
    """Index (int32 0..7) of an exact E2M1 magnitude ``a`` (``searchsorted`` on the grid)."""
    idx = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
    idx += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
    return idx + (a >= 6.0).to(tl.int32)


@triton.jit
def encode_value(q, z):
    """``e2m1.encode_value(q, sign_like=z)``: exact grid values -> codes; zeros take z's sign."""
    neg = tl.where(q == 0.0, signbit(z), signbit(q))
    return (mag_index(tl.abs(q)) | (neg.to(tl.int32) << 3)).to(tl.uint8)


@triton.jit
def bracket(z):
    """``e2m1.bracket``: adjacent signed grid points (lo, hi) around clip(z, -6, 6), fp32 (NaN -> (6, 6))."""
    zc = tl.where(z != z, 6.0, tl.minimum(tl.maximum(z, -6.0), 6.0))
    a = tl.abs(zc)
    lo_i = mag_index(a)  # largest grid magnitude <= a
    lo_m = e2m1_mag(lo_i)
    hi_m = tl.where(a > lo_m, e2m1_mag(lo_i + 1), lo_m)
    neg = zc < 0.0
    lo = tl.where(neg, -hi_m, lo_m)
    hi = tl.where(neg, -lo_m, hi_m)
    return lo, hi


@triton.jit
def guided_full(z, roll_code):
    """``rounding.guided_full``: the bracket point nearest the rollout code (uint8 codes out)."""
    lo, hi = bracket(z)
    q_roll = e2m1_decode(roll_code)
    q = tl.where(tl.abs(lo - q_roll) <= tl.abs(hi - q_roll), lo, hi)
    return tl.where(q == q_roll, roll_code.to(tl.uint8), encode_value(q, z))


@triton.jit
def guided_compact(z, bit):
    """``rounding.guided_compact``: the bracket point whose mantissa bit equals ``bit`` (0/1)."""
    lo, hi = bracket(z)
    lo_bit = mag_index(tl.abs(lo)) & 1
    q = tl.where(lo_bit == bit.to(tl.int32), lo, hi)
    return encode_value(q, z)


@triton.jit
def pow2(n):
    """``mxfp4.pow2``: exact fp32 2**n for int32 n (n < -126 gives 2**-127, n = 128 gives inf)."""
    normal = (tl.maximum(n + 127, 1) << 23).to(tl.float32, bitcast=True)
    return tl.where(n >= -126, normal, 2.0**-127)


@triton.jit
def e4m3_round(v):
    """fp32 ``v`` (>= 0, <= 448, or NaN) -> (value as fp32, float8_e4m3fn byte): RNE like torch's cast.

    NaN (not reached from finite inputs since S_enc saturates at FLT_MAX) gives 0xFF, the reference's byte on x86.
    """
    bits = v.to(tl.int32, bitcast=True)
    # Normal range (v >= 2^-6): round the fp32 mantissa to 3 bits, ties to even.
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    r_norm = rb.to(tl.float32, bitcast=True)
    # Subnormal range: multiples of 2^-9; fp32 addition rounds to nearest even.
    r_sub = (v + 16384.0) - 16384.0
    r = tl.where(v >= 0.015625, r_norm, r_sub)
    rbits = r.to(tl.int32, bitcast=True)
    byte_norm = (((rbits >> 23) - 120) << 3) | ((rbits >> 20) & 7)
    byte_sub = (r * 512.0).to(tl.int32)
    byte = tl.where(r >= 0.015625, byte_norm, byte_sub)
    nan = v != v
    return tl.where(nan, v, r), tl.where(nan, 0xFF, byte).to(tl.uint8)


@triton.jit
def e4m3_value(byte):
    """float8_e4m3fn byte (any int type) -> exact fp32 value (NaN for 0x7F/0xFF)."""
    b = byte.to(tl.int32) & 0xFF
    ex = (b >> 3) & 15
    man = b & 7
    normal = (((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ex == 0, man.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((ex == 15) & (man == 7), float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def nvfp4_encode_scale(g):
    """``nvfp4.encode_scale``: 2688 / g (one IEEE division) saturated at FLT_MAX, 1.0 where g <= 0."""
    safe = tl.where(g > 0.0, g, 1.0)
    s = tl.minimum(tl.div_rn(2688.0 + tl.zeros_like(safe), safe), FLT_MAX)
    return tl.where(g > 0.0, s, 1.0)


@triton.jit
def nvfp4_block_scale(amax_b, s_enc):
    """``NVFP4Format.block_scales``: e4m3(min(s_enc * amax_b / 6, 448)) -> (fp32 value, byte)."""
    v = tl.div_rn(s_enc * amax_b, 6.0)
    v = tl.where(v > 448.0, 448.0, v)  # clamp(max=448), NaN kept
    return e4m3_round(v)


@triton.jit
def nvfp4_block_scale_hw(amax_b, s_enc):
    """``nvfp4_block_scale`` on the GPU, in fewer instructions (same results, bit for bit):
    v = RN(RN(s_enc * amax_b) / 6) by a Markstein step with RN(1/6) instead of an IEEE division (exact where v is
    normal; a smaller v rounds to E4M3 zero either way), the dividend clamped at 2688 first (above it v > 448,
    which the clamp makes 448 anyway; NaN kept), then the GPU's RNE conversion to E4M3 and back (NaN: the
    reference's byte 0xFF, not the conversion's 0x7F)."""
    y = s_enc * amax_b
    y = tl.where(y > 2688.0, 2688.0, y)
    v = markstein(y, -6.0, 0.1666666716337204)  # RN(1/6)
    e4 = v.to(tl.float8e4nv)
    nan = v != v
    return tl.where(nan, v, e4.to(tl.float32)), tl.where(nan, 0xFF, e4.to(tl.uint8, bitcast=True)).to(tl.uint8)


@triton.jit
def mx_exponent(amax_b, FMT: tl.constexpr):
    """``MXFP4Format.block_scales`` exponent (int32, [-127, 127]) of the block amax, floor or ceil rule."""
    if FMT == MXFP4_FLOOR:
        e = ((amax_b.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 129  # floor(log2) - 2; subnormal -> clamp
    else:
        t = tl.div_rn(amax_b, 6.0)
        tb = t.to(tl.int32, bitcast=True)
        b = (tb >> 23) & 0xFF
        man = tb & 0x7FFFFF
        e_norm = b - 127 + (man != 0).to(tl.int32)
        e_sub = tl.where(man > 0x400000, -126, -127)
        e = tl.where(b > 0, e_norm, e_sub)
    e = tl.where(amax_b > 0.0, e, -127)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def to_dtype(v, dtype: tl.constexpr):
    """fp32 -> ``dtype`` with round-to-nearest-even; bf16 is rounded by bits (the CPU interpreter truncates)."""
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        r = tl.where(v != v, 0x7FC0, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)  # NaN: the GPU's is 0x7FFFFFFF
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def div_fast(a, b, rb):
    """RN(a / b) from rb = RN(1 / b) by one Markstein correction (3 flops instead of an IEEE division).

    Exact for results in the normal range when b is a normal number whose significand is not all ones;
    ``div_needs_slow`` flags the rest (the caller then redoes its tile with ``tl.div_rn``).
    """
    q0 = a * rb
    q = tl.fma(rem_of(a, b, q0), rb, q0)
    return tl.where(q0 == 0.0, q0, q)  # keeps the sign of a zero quotient


@triton.jit
def markstein(a, neg_b, rb):
    """RN(a / b) from rb = RN(1 / b) and neg_b = -b (``div_fast`` with the divisor negated once per block);
    a zero quotient comes out +0."""
    q0 = a * rb
    return tl.fma(tl.fma(q0, neg_b, a), rb, q0)


@triton.jit
def rem_of(a, b, q0):
    return tl.fma(-q0, b, a)


@triton.jit
def div_needs_slow(q0, b):
    """1 where ``div_fast`` may differ from an IEEE division: tiny/huge/non-finite quotient or awkward b."""
    aq = tl.abs(q0)
    bad_q = (q0 != 0.0) & ((aq < 1e-30) | (aq > 1e30) | (q0 != q0))
    bb = b.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bad_b = (bb < 0x00800000) | (bb >= 0x7F800000) | ((bb & 0x7FFFFF) == 0x7FFFFF)
    return bad_q | bad_b


@triton.jit
def _words_4d(rows, rmask, row_stride, kt, NW, NBT: tl.constexpr, P: tl.constexpr, V: tl.constexpr):
    """Offsets and mask [BM, NBT, P // V, V] of the words of blocks [kt*NBT, (kt+1)*NBT) (P words per block)."""
    c = (kt * (NBT * P) + tl.arange(0, NBT)[None, :, None, None] * P + tl.arange(0, P // V)[None, None, :, None] * V
         + tl.arange(0, V)[None, None, None, :])
    return rows[:, None, None, None] * row_stride + c, rmask[:, None, None, None] & (c < NW)


@triton.jit
def load_words(ptr, rows, rmask, row_stride, kt, NW, NBT: tl.constexpr, P: tl.constexpr):
    """Words [BM, NBT, P] of blocks [kt*NBT, (kt+1)*NBT), 0 out of bounds, read as [BM, NBT, P / V, V] with V
    words in 16 bytes. Triton then gives the V-word runs of one block to the same thread, not to P / V threads (as
    it does for a [BM, NBT, P] load), so a block's constants are computed once, by the thread that holds it."""
    V: tl.constexpr = min(128 // ptr.dtype.element_ty.primitive_bitwidth, P)
    off, m = _words_4d(rows, rmask, row_stride, kt, NW, NBT, P, V)
    w = tl.load(ptr + off, mask=m, other=0)
    return w.reshape(w.shape[0], NBT, P)


@triton.jit
def store_words(ptr, rows, rmask, kt, NW, words, NBT: tl.constexpr, P: tl.constexpr, WHOLE: tl.constexpr):
    """Store words [BM, NBT, P] of blocks [kt*NBT, (kt+1)*NBT) into rows of NW words, in bounds (as [BM, NBT,
    P / V, V] if WHOLE, to keep ``load_words``' layout)."""
    if WHOLE:
        V: tl.constexpr = min(128 // ptr.dtype.element_ty.primitive_bitwidth, P)
        off, m = _words_4d(rows, rmask, NW, kt, NW, NBT, P, V)
        tl.store(ptr + off, words.reshape(words.shape[0], NBT, P // V, V), mask=m)
    else:
        c = kt * (NBT * P) + tl.arange(0, NBT)[None, :, None] * P + tl.arange(0, P)[None, None, :]
        tl.store(ptr + rows[:, None, None] * NW + c, words, mask=rmask[:, None, None] & (c < NW))


@triton.jit
def load_nc(ptr, mask, BITS: tl.constexpr):
    """GPU: an unsigned BITS-bit (8, 16 or 64) read-only load per element as int32 (int64 for 64; 0 where masked
    off), by inline PTX. Unlike ``tl.load`` it is laid out as its users are, so per-block values loaded next to a
    tile need no layout conversion through shared memory."""
    if BITS == 64:
        asm: tl.constexpr = "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; @p ld.global.nc.u64 $0, [$1]; }"
        out = tl.inline_asm_elementwise(asm, "=l,l,r", [ptr.to(tl.int64, bitcast=True), mask.to(tl.int32)],
                                        dtype=tl.int64, is_pure=True, pack=1)
    else:
        U: tl.constexpr = "u8" if BITS == 8 else "u16"
        asm: tl.constexpr = ("{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc." + U
                             + " $0, [$1]; }")
        out = tl.inline_asm_elementwise(asm, "=r,l,r", [ptr.to(tl.int64, bitcast=True), mask.to(tl.int32)],
                                        dtype=tl.int32, is_pure=True, pack=1)
    return out


@triton.jit
def prmt(a, b, sel, HW: tl.constexpr = True):
    """PTX ``prmt.b32``: byte i of the result is byte n & 7 of b:a (a: bytes 0-3) for n = nibble i of sel, or, if
    n's bit 3 is set, that byte's bit 7 copied to all 8 bits; sel's bits 16-31 are ignored. a, b, sel: 32-bit,
    broadcast; uint32 out. HW: one instruction on the GPU; else the same by shifts (the interpreter)."""
    if HW:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        a32, b32 = a.to(tl.uint32, bitcast=True), b.to(tl.uint32, bitcast=True)
        s32 = (sel + tl.zeros_like(a32)).to(tl.uint32, bitcast=True)
        out = tl.zeros_like(a32 | b32 | s32)
        for i in tl.static_range(4):
            n = (s32 >> (4 * i)) & 15
            k = n & 7
            byte = tl.where(k < 4, a32 >> (8 * (k & 3)), b32 >> (8 * (k & 3))) & 0xFF
            byte = tl.where((n & 8) != 0, tl.where((byte & 0x80) != 0, 0xFF, 0), byte).to(tl.uint32)
            out = out | (byte << (8 * i))
        return out


@triton.jit
def split4(x):
    """x [..., P] (P % 4 == 0) -> x[..., j::4] for j = 0..3: element p = 4c + j of each run of 4 -> [..., c]."""
    y = tl.reshape(x, x.shape[:-1] + [x.shape[-1] // 4, 2, 2])
    a, b = tl.split(y)  # j % 2 = 0 / 1, over j // 2
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def code_words(il, ih, w, ok, HW: tl.constexpr):
    """NVFP4 code words (int32 [BM, NBT, P // 4]: 8 codes each, code 8c + j at bits 4j) from the magnitude indices
    il, ih (int32, 0..7) of the elements of bf16 pairs w (uint32 [BM, NBT, P]) and ok [BM, NBT] (False: the block
    scale is 0, all signs +). The signs come from x's words by four byte permutes per code word, each byte's sign
    copied to a whole byte (``prmt``'s bit 3), instead of a shift and an and per element."""
    i0, i1, i2, i3 = split4(il | (ih << 4))  # a code byte's magnitudes per pair
    iw = i0 | (i1 << 8) | (i2 << 16) | (i3 << 24)
    w0, w1, w2, w3 = split4(w)
    a = prmt(w0, w1, 0xFBD9, HW)  # sign bytes [lo0, lo1, hi0, hi1]: bytes 1 and 3 hold the bf16 signs
    b = prmt(w2, w3, 0xFBD9, HW)  # [lo2, lo3, hi2, hi3]
    lo_s = prmt(a, b, 0x5410, HW)  # the low elements' signs, one byte per pair
    hi_s = prmt(a, b, 0x7632, HW)
    sw = (lo_s & 0x08080808) | (hi_s & 0x80808080)
    return iw | (sw & tl.where(ok, -1, 0)[:, :, None]).to(tl.int32, bitcast=True)


@triton.jit
def store_code_words(iw, orows, rows, rmask, blk, bmask, NB, codes_ptr, bits_ptr, P: tl.constexpr,
                     WRITE_CODES: tl.constexpr, WRITE_BITS: tl.constexpr):
    """Code words iw (int32 [BM, NBT, P // 4]: 8 codes each) to rows ``orows``, and the record's mantissa bits
    (bit 0 of each code: one byte per code word) to rows ``rows``."""
    c = tl.arange(0, P // 4)[None, None, :]
    m = rmask[:, None, None] & bmask[:, :, None]
    if WRITE_CODES:
        off = orows[:, None, None] * (NB * P // 4) + blk[:, :, None] * (P // 4) + c
        tl.store(codes_ptr.to(tl.pointer_type(tl.int32)) + off, iw, mask=m)
    if WRITE_BITS:
        off = rows[:, None, None] * (NB * P // 4) + blk[:, :, None] * (P // 4) + c
        tl.store(bits_ptr + off, nibble_lsbs(iw).to(tl.uint8), mask=m)


@triton.jit
def nibble_lsbs(iw):
    """Bit 0 of each nibble of the int32 words iw, gathered: bit j of the byte out (int32 0..255) is bit 4j of iw."""
    v = iw & 0x11111111
    v = (v | (v >> 3)) & 0x03030303  # nibbles 2c, 2c + 1 at bits 8c, 8c + 1
    v = v | (v >> 6)  # nibbles 0-3 at bits 0-3, 4-7 at bits 16-19
    return (v | (v >> 12)) & 0xFF


@triton.jit
def asm2(asm: tl.constexpr, a, b):
    """One PTX instruction ``asm`` on two 32-bit operands ($1, $2), uint32 out (GPU only; a, b broadcast)."""
    return tl.inline_asm_elementwise(asm, "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def high_halves(lo, hi, HW: tl.constexpr):
    """int32 words of the high 16 bits of lo (low half) and of hi (high half) (int32 each): a bf16 pair from the
    fp32 bits of two bf16-exact values. One byte permute on the GPU instead of a shift, a mask and an or."""
    if HW:
        return prmt(lo, hi, tl.full(lo.shape, 0x7632, tl.uint32)).to(tl.int32, bitcast=True)
    else:
        return ((lo >> 16) & 0xFFFF) | (hi & -65536)


@triton.jit
def bf16_rne_pair(d1, d3, HW: tl.constexpr):
    """fp32 d1, d3 (positive, finite) rounded to bf16 precision, ties to even (fp32 out): one ``cvt.rn.bf16x2``
    for both on the GPU, by bits elsewhere (the interpreter's conversion truncates)."""
    if HW:
        p = asm2("cvt.rn.bf16x2.f32 $0, $2, $1;", d1, d3)  # [lo: d1, hi: d3]
        return (p << 16).to(tl.float32, bitcast=True), (p & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return rne_bf16(d1), rne_bf16(d3)


@triton.jit
def rne_bf16(d):
    """fp32 d (positive, finite) rounded to bf16 precision, ties to even, by its bits (fp32 out)."""
    b = d.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def store_u8(ptr, v, mask, HW: tl.constexpr):
    """Store the low bytes of v (int32) at ptr where mask. GPU: one ``st.global.u8`` per element by inline PTX, in
    the layout v has (``tl.store`` may first move v through shared memory into a layout of its own)."""
    if HW:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.u8 [$1], $3; mov.b32 $0, 0; }", "=r,l,r,r",
            [ptr.to(tl.int64, bitcast=True), mask.to(tl.int32), v.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, v.to(tl.uint8), mask=mask)


@triton.jit
def recip_rn(x, HW: tl.constexpr):
    """RN(1 / x) for fp32 x of exponent -124..124 (e.g. an E4M3 value): on the GPU ``MUFU.RCP`` and one Newton
    step, the in-range path of libdevice's correctly rounded ``rcp_rn`` without its out-of-range branch (a call
    that splits the kernel's code and the scheduling around it); ``tl.div_rn`` elsewhere."""
    if HW:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
        return tl.fma(r, tl.fma(-x, r, 1.0), r)
    else:
        return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def unpair(w, XDT: tl.constexpr):
    """A word of two adjacent elements (uint32 for 16-bit x, uint64 for fp32) -> (even, odd) as fp32."""
    if XDT == 2:
        lo = (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        hi = (w >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    elif XDT == 0:  # bf16: its bits are the high half of the fp32 bits
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        lo = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _absmax_bf16x2(a, b):
    return asm2("max.xorsign.abs.bf16x2 $0, $1, $2;", a, b)


@triton.jit
def block_amax(w, XDT: tl.constexpr, HW: tl.constexpr):
    """max |x| over the last axis of the words w [BM, NBT, P] (``unpair``'s pairs): the block amaxes [BM, NBT],
    fp32. bf16 on the GPU: one packed max of magnitudes (``max.xorsign.abs.bf16x2``) per word, then the two halves;
    NaN is ignored as by the fp32 max (an all-NaN block gives NaN)."""
    if HW and XDT == 0:
        lo, hi = unpair(tl.reduce(w, 2, _absmax_bf16x2), XDT)
        return tl.maximum(tl.abs(lo), tl.abs(hi))
    else:
        lo, hi = unpair(w, XDT)
        return tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=2)


@triton.jit
def pair(lo, hi, XDT: tl.constexpr, HW_CVT: tl.constexpr):
    """fp32 (even, odd) -> one word of two elements of the dtype selected by XDT (RNE)."""
    if XDT == 2:
        return lo.to(tl.uint32, bitcast=True).to(tl.uint64) | (hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
    else:
        if XDT == 0:
            if HW_CVT:
                a = lo.to(tl.bfloat16).to(tl.uint16, bitcast=True)
                b = hi.to(tl.bfloat16).to(tl.uint16, bitcast=True)
            else:
                a = to_dtype(lo, tl.bfloat16).to(tl.uint16, bitcast=True)
                b = to_dtype(hi, tl.bfloat16).to(tl.uint16, bitcast=True)
        else:
            a = lo.to(tl.float16).to(tl.uint16, bitcast=True)
            b = hi.to(tl.float16).to(tl.uint16, bitcast=True)
        return a.to(tl.uint32) | (b.to(tl.uint32) << 16)


@triton.jit
def rne_index(z):
    """E2M1 magnitude index (int32 0..7) of RNE(|z|) (== ``e2m1_rne`` & 7 for z not NaN; NaN/Inf -> 7).

    Adding C = 2^(22 + e), e = clamp(floor(log2|z|), 0, 3), rounds |z| to the grid step of its binade
    (0.5 below 2, then 1, 2) with ties to even in one fp32 addition; the result's low bits count steps.
    """
    cb = tl.minimum(tl.maximum(z.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000), 0x41000000) + (22 << 23)
    t = tl.abs(z) + cb.to(tl.float32, bitcast=True)
    return tl.minimum(t.to(tl.int32, bitcast=True) - cb + (cb >> 22) - 298, 7)


@triton.jit
def floor_index(z):
    """(index of the grid point at or below min(|z|, 6), 1 if |z| is off the grid else 0), int32; NaN -> 6."""
    u = tl.minimum(z.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x40C00000)
    big = u >= 0x3F800000  # |z| >= 1: grid step = 1 mantissa bit; below: steps of 0.5
    fl = tl.where(big, (u >> 22) - 252, (u >= 0x3F000000).to(tl.int32))
    inexact = tl.where(big, (u & 0x3FFFFF) != 0, (u != 0) & (u != 0x3F000000))
    return fl, inexact.to(tl.int32)


@triton.jit
def compact_index(z, bit):
    """``guided_compact`` as a magnitude index (int32 0..7): of the grid points around min(|z|, 6),
    the one whose mantissa bit is ``bit`` (0/1, int32)."""
    fl, inexact = floor_index(z)
    return fl + ((fl ^ bit) & inexact & 1)


@triton.jit
def full_code(z, neg, roll):
    """``guided_full`` (int32 code) from magnitude indices; neg: 8 where z is negative (or -0) else 0.

    The bracket point nearest the rollout code, ties to the lower signed one; a zero equal to the
    rollout's zero keeps the rollout's code (its sign).
    """
    fl, inexact = floor_index(z)
    hi_i = fl + inexact
    r = roll.to(tl.int32)
    q_roll = e2m1_mag(r & 7)
    q_roll = tl.where((r & 8) == neg, q_roll, -q_roll)  # in the frame where z >= 0
    d_lo = tl.abs(e2m1_mag(fl) - q_roll)
    d_hi = tl.abs(e2m1_mag(hi_i) - q_roll)
    pick_hi = tl.where(neg != 0, d_hi <= d_lo, d_hi < d_lo)  # the lower signed point is hi when z < 0
    idx = tl.where(pick_hi, hi_i, fl)
    return tl.where((idx == 0) & ((r & 7) == 0), r, idx | neg)


@triton.jit
def deq_mags(il, ih, sf3, e3, s3, FMT: tl.constexpr, FAST_DIV: tl.constexpr):
    """Dequantized magnitudes of the E2M1 indices il, ih (int32, one per element of each pair): NVFP4 index value
    * block scale sf3 / S_enc s3 (an exact product, then one Markstein step on RN(1 / S_enc) or the IEEE
    division), MXFP4 index value * 2**e3 (e3: the block exponent). sf3, e3, s3 broadcast to il."""
    if FMT == NVFP4:
        vl = e2m1_mag(il) * sf3  # exact: <= 2 + 4 significant bits
        vh = e2m1_mag(ih) * sf3
        if FAST_DIV:
            re = tl.div_rn(tl.full(s3.shape, 1.0, tl.float32), s3)
            vl = markstein(vl, -s3, re)
            vh = markstein(vh, -s3, re)
        else:
            vl, vh = tl.div_rn(vl, s3), tl.div_rn(vh, s3)
    else:
        p2e = pow2(e3)
        vl, vh = e2m1_mag(il) * p2e, e2m1_mag(ih) * p2e
    return vl, vh

