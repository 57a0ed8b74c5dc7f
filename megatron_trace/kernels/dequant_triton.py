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
from .dispatch import cdiv
from .layout import check_fp4
from .quant_triton import GUIDED_FULL, _load_guidance, _unscale


@triton.jit
def dequant_kernel(
    codes_ptr, scales_ptr, g_ptr, out_ptr, M, K, NB, NUM_KT: tl.constexpr,
    FMT: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr, NBT: tl.constexpr,
    FAST_DIV: tl.constexpr,
):
    """out[M, K] = decode(codes) * scale (``fmt.unscale``), cast once to out's dtype."""
    _dequant_rows(tl.program_id(0), codes_ptr, scales_ptr, g_ptr, out_ptr, M, K, NB, NUM_KT, FMT, G_MODE, B, BLOCK_M,
                  NBT, FAST_DIV)


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
    codes_ptr, scales_ptr, g_ptr, outw_ptr, out_ptr, M, NB, NUM_KT: tl.constexpr,
    ODT: tl.constexpr, FMT: tl.constexpr, G_MODE: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr,
    NBT: tl.constexpr, FAST_DIV: tl.constexpr, HW_CVT: tl.constexpr, BY_MAG: tl.constexpr,
):
    """``dequant_kernel`` for K % B == 0: each code byte becomes one output word (two elements, outw_ptr).

    BY_MAG: bf16 by per-block constants (``_tile_by_consts``: NVFP4; MXFP4 on the GPU); else, and for fp32 / fp16,
    ``_pair_by_index`` (decode, multiply, divide per element).

    A program whose rows have an S_enc outside the range where the reciprocal division is exact takes
    ``dequant_kernel``'s element-wise path with IEEE division instead, a row and a quarter tile at a time, into
    out_ptr (the same buffer as elements): one launch per call, whatever the amax.
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
    slow = qp._needs_exact(tl.zeros([BLOCK_M, NBT], tl.float32), s_b, G_MODE, 1, True, False)
    NW = NB * P
    if slow == 0:
        for kt in range(NUM_KT):
            if BY_MAG and ODT == 0 and (FMT == f.NVFP4 or HW_CVT):
                _tile_by_consts(codes_ptr, scales_ptr, outw_ptr, s_b, rows, rmask, kt, NB, NW, FMT, P, NBT, FAST_DIV,
                                HW_CVT)
            else:
                blk = kt * NBT + tl.arange(0, NBT)[None, :]
                byte = tl.load(scales_ptr + rows[:, None] * NB + blk, mask=rmask[:, None] & (blk < NB), other=0)
                wcol = kt * (NBT * P) + tl.arange(0, NBT)[None, :, None] * P + tl.arange(0, P)[None, None, :]
                m3 = rmask[:, None, None] & (wcol < NW)
                woff = rows[:, None, None] * NW + wcol
                c = tl.load(codes_ptr + woff, mask=m3, other=0).to(tl.int32)
                words = _pair_by_index(c, byte, s_b[:, :, None], ODT, FMT, FAST_DIV, HW_CVT)
                tl.store(outw_ptr + woff, words.to(outw_ptr.dtype.element_ty, bitcast=True), mask=m3)
    else:  # the exact redo: few live values (the fast path's registers are the kernel's)
        QR: tl.constexpr = 4 if NBT >= 4 else 1
        for r in range(BLOCK_M):
            if pid * BLOCK_M + r < M:  # (a row past M would store nothing: skipped, not masked through)
                _dequant_rows(pid * BLOCK_M + r, codes_ptr, scales_ptr, g_ptr, out_ptr, M, NB * B, NB, NUM_KT * QR,
                              FMT, G_MODE, B, 1, NBT // QR, False)


@triton.jit
def _tile_by_consts(codes_ptr, scales_ptr, outw_ptr, s_b, rows, rmask, kt, NB, NW, FMT: tl.constexpr, P: tl.constexpr,
                    NBT: tl.constexpr, FAST_DIV: tl.constexpr, HW_CVT: tl.constexpr):
    """One K tile of bf16 words by per-block constants (GPU: ``_pair_by_table``, else ``_pair_by_consts``; MXFP4:
    the GPU only, by ``_mx_consts``).

    The tile is [P // 4, L, BM, H, 4] (quarter block, block mod L, row, block // L, word; L = min(NBT, 16)): Triton
    orders dims of equal contiguity by index, so a thread loads four code bytes and stores four words, a warp's
    32 threads take 16 adjacent blocks of one row (loads and stores coalesce, no shuffle), the warps take rows
    (one S_enc per thread) and the H blocks 16 apart are a thread's repeats."""
    Q: tl.constexpr = P // 4
    L: tl.constexpr = 16 if NBT > 16 else NBT
    H: tl.constexpr = NBT // L
    blk = kt * NBT + tl.arange(0, H)[None, None, :] * L + tl.arange(0, L)[:, None, None]  # [L, 1, H]
    r3 = rows[None, :, None]
    byte = tl.load(scales_ptr + r3 * NB + blk, mask=rmask[None, :, None] & (blk < NB), other=0)  # [L, BM, H]
    if FMT == f.NVFP4:
        s1 = tl.reshape(s_b, (s_b.shape[0],))
        re = tl.div_rn(tl.full(s1.shape, 1.0, tl.float32), s1)[None, :, None]  # per row: RN(1 / S_enc)
        d1, d3 = _block_consts(byte, s1[None, :, None], re, FAST_DIV, HW_CVT)
    else:
        d1, d3 = _mx_consts(byte)
    wcol = (blk[None, :, :, :, None] * P + tl.arange(0, Q)[:, None, None, None, None] * 4
            + tl.arange(0, 4)[None, None, None, None, :])  # [Q, L, 1, H, 4]
    m5 = rmask[None, None, :, None, None] & (wcol < NW)
    woff = rows[None, None, :, None, None] * NW + wcol
    c = tl.load(codes_ptr + woff, mask=m5, other=0).to(tl.int32)
    d1, d3 = d1[None, :, :, :, None], d3[None, :, :, :, None]
    if HW_CVT:
        words = _pair_by_table(c, d1, d3, FMT)
    else:
        words = _pair_by_consts(c, d1, d3)
    tl.store(outw_ptr + woff, words.to(outw_ptr.dtype.element_ty, bitcast=True), mask=m5)


@triton.jit
def _pair_by_index(c, byte, s3, ODT: tl.constexpr, FMT: tl.constexpr, FAST_DIV: tl.constexpr, HW_CVT: tl.constexpr):
    """Output words of code bytes c [BM, NBT, P] (int32): decode, times the block scale (byte [BM, NBT]),
    divided by S_enc (s3 [BM, 1, 1]) per element, the code's sign by bit, one conversion."""
    cl, ch = c & 15, c >> 4
    e3 = (byte.to(tl.int32) - 127)[:, :, None]  # MXFP4's block exponent
    vl, vh = f.deq_mags(cl & 7, ch & 7, f.e4m3_value(byte)[:, :, None], e3, s3, FMT, FAST_DIV)
    vl = (vl.to(tl.int32, bitcast=True) | ((cl & 8) << 28)).to(tl.float32, bitcast=True)  # code sign
    vh = (vh.to(tl.int32, bitcast=True) | ((ch & 8) << 28)).to(tl.float32, bitcast=True)
    return f.pair(vl, vh, ODT, HW_CVT)


@triton.jit
def _block_consts(byte, s, re, FAST_DIV: tl.constexpr, HW_CVT: tl.constexpr):
    """4 * d1 = RN(4 sf / S_enc), 4 * d3 = RN(6 sf / S_enc) for the E4M3 block scales byte (any shape; s = S_enc,
    re = RN(1 / S_enc) broadcast to it), as ``quant_guided_triton._block_consts`` (of 4 sf: exact), rounded to bf16
    (on the GPU: left to ``_pair_by_table``); NaN for a NaN scale. (The factor 4 makes ``_half_by_consts``'s
    exponent base 124, whose low two bits are 0.)"""
    if HW_CVT:  # the GPU's conversion: exact for E4M3 (NaN kept)
        sf = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:  # by bits (the interpreter's conversion differs)
        sf = f.e4m3_value(byte)
    if FAST_DIV:
        d1, d3 = f.markstein(sf * 4.0, -s, re), f.markstein(sf * 6.0, -s, re)
    else:
        d1, d3 = tl.div_rn(sf * 4.0, s), tl.div_rn(sf * 6.0, s)
    if not HW_CVT:  # the bf16 rounding by bits of a NaN may give -0
        nan = sf != sf
        d1 = tl.where(nan, float("nan"), f.rne_bf16(d1))
        d3 = tl.where(nan, float("nan"), f.rne_bf16(d3))
    return d1, d3


@triton.jit
def _mx_consts(byte):
    """d1 = 2**(e - 127) (the reference's ``mxfp4.pow2``: 2**-127 for e = 0, Inf for e = 255) and d3 = 1.5 d1, as
    fp32 by bits (no arithmetic: a subnormal stays exact), for the E8M0 scale bytes e."""
    e = byte.to(tl.int32)
    d1 = tl.where(e == 0, 0x00400000, e << 23)
    d3 = tl.where(e == 0, 0x00600000, tl.where(e == 255, 0x7F800000, (e << 23) | 0x00400000))
    return d1.to(tl.float32, bitcast=True), d3.to(tl.float32, bitcast=True)


@triton.jit
def _half_by_consts(c, q, d1, d3, SH: tl.constexpr):
    """|value| bits (fp32 as uint32) of the code nibble at bit SH (0 or 4) of the code bytes c (int32 < 256), from
    ``_block_consts``' 4 * d1, 4 * d3: the E2M1 magnitude of index n = (c >> SH) & 7 is 2**k or 1.5 * 2**k with
    2**k = 2**((n >> 1) - 1) (n >= 1), so the value is 2**k / 4 (exponent 124 | n's bits 1-2) times 4 * d1, or
    times 4 * d3 for n = 3, 5, 7 (q's bit SH); 0 for n = 0."""
    base = tl.where((c & (7 << SH)) != 0, 0x3E000000, 0)
    p2 = ((c << (22 - SH)) & 0x1800000) | base
    d = tl.where((q & (1 << SH)) != 0, d3, d1)
    return (d * p2.to(tl.float32, bitcast=True)).to(tl.uint32, bitcast=True)


@triton.jit
def _pair_by_consts(c, d1, d3):
    """bf16 words of the code bytes c (int32) from ``_block_consts``' 4 * d1, 4 * d3 (bf16-exact, broadcast to c):
    one multiply per element (exact: normal in the fast path's S_enc range), the high halves (vh's low half is 0,
    or vl and vh are NaN), the codes' signs by xor (q * sf's sign): bits 3, 7 -> 15, 31."""
    q = c & ((c >> 1) | (c >> 2))  # bit 0 (4): the low (high) nibble's index is 3, 5 or 7
    vl, vh = _half_by_consts(c, q, d1, d3, 0), _half_by_consts(c, q, d1, d3, 4)
    return ((vl >> 16) | vh) ^ ((c * 0x1001000).to(tl.uint32, bitcast=True) & 0x80008000)


@triton.jit
def _pair_by_table(c, d1, d3, FMT: tl.constexpr):
    """``_pair_by_consts`` for bf16 on the GPU: per block, the bf16 values of the 8 E2M1 magnitudes as two 8-byte
    tables (their low bytes, their high bytes); per word, one byte permute per table picks both elements' bytes by
    their indices (selector nibbles 0 and 2), a third interleaves them, and the codes' signs are xor-ed in.

    The table: NVFP4, ``_block_consts``' 4 * d1, 4 * d3 (fp32) rounded to bf16 and packed (one cvt), times 2**k in
    bf16x2 multiplies (exact), 0 * d1 for index 0 (+0; NaN for a NaN scale): [0, 0.5, 1, 1.5 | 2, 3, 4, 6] * sf /
    S_enc. MXFP4, ``_mx_consts``' d1 = 2**(e - 127), d3 = 1.5 d1 (exact in bf16, subnormal ones too), times
    [0, 1/2], 1, 2 and 4: the reference's fp32 products (Inf past the range, NaN for 0 * Inf) rounded to bf16."""
    p13 = f.asm2("cvt.rn.bf16x2.f32 $0, $2, $1;", d1, d3)  # [lo: (4) d1, hi: (4) d3], RNE
    p11 = f.prmt(p13, p13, tl.full(p13.shape, 0x1010, tl.uint32))  # [(4) d1, (4) d1]
    if FMT == f.NVFP4:
        e01 = f.asm2("mul.rn.bf16x2 $0, $1, $2;", p11, tl.full(p13.shape, 0x3E000000, tl.uint32))  # * [0, 1/8]
        e23 = f.asm2("mul.rn.bf16x2 $0, $1, $2;", p13, tl.full(p13.shape, 0x3E803E80, tl.uint32))  # * [1/4, 1/4]
        e45 = f.asm2("mul.rn.bf16x2 $0, $1, $2;", p13, tl.full(p13.shape, 0x3F003F00, tl.uint32))  # * [1/2, 1/2]
        e67 = p13
    else:
        e01 = f.asm2("mul.rn.bf16x2 $0, $1, $2;", p11, tl.full(p13.shape, 0x3F000000, tl.uint32))  # * [0, 1/2]
        e23 = p13
        e45 = f.asm2("mul.rn.bf16x2 $0, $1, $2;", p13, tl.full(p13.shape, 0x40004000, tl.uint32))  # * [2, 2]
        e67 = f.asm2("mul.rn.bf16x2 $0, $1, $2;", p13, tl.full(p13.shape, 0x40804080, tl.uint32))  # * [4, 4]
    even, odd = tl.full(p13.shape, 0x6420, tl.uint32), tl.full(p13.shape, 0x7531, tl.uint32)
    lo_a, hi_a = f.prmt(e01, e23, even), f.prmt(e01, e23, odd)  # indices 0-3: the bf16s' low / high bytes
    lo_b, hi_b = f.prmt(e45, e67, even), f.prmt(e45, e67, odd)  # indices 4-7
    sel = ((c | (c << 4)) & 0x707).to(tl.uint32)  # nibble 0: the low element's index, nibble 2: the high one's
    lo = f.prmt(lo_a, lo_b, sel)  # bytes 0, 2: the low bytes of the two elements' bf16
    hi = f.prmt(hi_a, hi_b, sel)
    word = f.prmt(lo, hi, tl.full(sel.shape, 0x6240, tl.uint32))
    return word ^ ((c * 0x1001000).to(tl.uint32, bitcast=True) & 0x80008000)


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
    """``t.dequantize(dtype)`` on the GPU (dtype bf16, fp16 or fp32; ``ops.dequantize`` takes others)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Triton dequantize writes bfloat16, float16 or float32, not {dtype} "
                        "(ops.dequantize with kernel='auto' runs the reference for it)")
    check_fp4(t)  # (the kernels read the parts with the sizes that t.shape implies)
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
    fmt_id = qk.fmt_id(t.fmt)
    if m and qk.PAIR_KERNEL and k == nb * fmt.block_size:
        odt, wdt = qk._WORD[dtype]
        cfg = qk.CONFIG["dequant" if fmt_id == 0 else "dequant_mxfp4"]
        bm, nbt, num_kt = qk.plan(k, fmt.block_size, cfg["tile"])
        dequant_pair_kernel[(cdiv(m, bm),)](
            codes, scales, g, out.view(wdt), out, m, nb, num_kt, ODT=odt, FMT=fmt_id, G_MODE=int(g_mode),
            B=fmt.block_size, BLOCK_M=bm, NBT=nbt, FAST_DIV=qk.FAST_DIV, HW_CVT=not qk.interpreting(codes),
            BY_MAG=bool(qk.DEQUANT_BY_MAGNITUDE), num_warps=cfg["num_warps"], enable_fp_fusion=False,
            **(qk.register_cap(cfg, codes) if dtype == torch.bfloat16 else {}),
        )
    elif m:
        cfg = qk.CONFIG["elem"]
        bm, nbt, num_kt = qk.plan(nb * fmt.block_size, fmt.block_size, cfg["tile"])
        dequant_kernel[(cdiv(m, bm),)](
            codes, scales, g, out, m, k, nb, num_kt, FMT=fmt_id, G_MODE=int(g_mode), B=fmt.block_size,
            BLOCK_M=bm, NBT=nbt, FAST_DIV=qk.FAST_DIV, num_warps=cfg["num_warps"], enable_fp_fusion=False,
        )
    return out.reshape(*lead, k)


def compact(record: FP4Tensor | FullGuidance) -> CompactGuidance:
    """The compact record (mantissa bits + scales) of a quantized tensor or a full record."""
    check_fp4(record, "record")
    codes = record.codes.contiguous()
    bits = torch.empty((*codes.shape[:-1], codes.shape[-1] // 4), dtype=torch.uint8, device=codes.device)
    n = bits.numel()
    if n:
        compact_kernel[(cdiv(n, 1024),)](codes, bits, n, BLOCK=1024, num_warps=4)
    return CompactGuidance(mantissa_bits=bits, block_scales=record.block_scales, global_amax=record.global_amax,
                           shape=record.shape, fmt=record.fmt)
