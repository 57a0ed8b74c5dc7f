"""The split-T loop's pieces shared by the decode attention kernels (``kv_attention_triton``'s FP4 kernels,
``kv_attention_dense_triton``): a program's (batch, KV head, split) and tile range, each tile's rows and which are
attended, its query rows, the online softmax and the partial's (max, sum) store; ``kv_attention_combine`` merges
the splits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """bf16 x bf16 -> fp32 MMA; in fp32 under the CPU interpreter (whose bf16 dot is not usable)."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a @ b (bf16 operands, fp32 accumulation); in fp32 under the CPU interpreter."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _trip_count(n_tiles, TILES: tl.constexpr):
    """The tile loop's trip count: runtime ``n_tiles`` when compiled, the constexpr ``TILES`` (> 0) under
    Triton's CPU interpreter, which cannot range() over a runtime scalar argument."""
    if TILES == 0:
        return n_tiles
    else:
        return TILES


@triton.jit
def _program(len_ptr, first_ptr, T, R, chunk, n_tiles, HKV: tl.constexpr, BT: tl.constexpr, HAS_LEN: tl.constexpr,
             HAS_FIRST: tl.constexpr, LOAD_R: tl.constexpr):
    """(batch, KV head, split, first tile's token, load end, attend end, first attended token, tiles) of this
    program.

    The attend end is <= the sequence's length (T, or ``lengths``); the loads end there too, or with ``LOAD_R`` at
    the split's end or R (rows in [end, R) are read and weigh 0: a bound that is a multiple of 16 keeps the
    loads' masks uniform over 16 rows, ~13% faster on the H200 than at T = 16k + 1). With ``first`` (the row's
    first attended token) the tiles before its tile are skipped: the tile boundaries stay those of the split
    (multiples of BT), so the tiles that run are the ones a kv_mask attending [first, end) would run, minus tiles
    that attend nothing."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    h = (pid % HKV).to(tl.int64)
    if HAS_LEN:
        n = tl.minimum(tl.load(len_ptr + b).to(tl.int32), T)  # a length past T attends T rows (the reference)
    else:
        n = T
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    load_end = end
    if LOAD_R:
        load_end = tl.minimum(start + chunk, R)
    first = 0
    if HAS_FIRST:
        first = tl.load(first_ptr + b).to(tl.int32)
        start = tl.maximum(start, first // BT * BT)
    if HAS_LEN or HAS_FIRST:  # no empty tiles
        n_tiles = tl.minimum(n_tiles, tl.cdiv(tl.maximum(end - start, 0), BT))
    return b, h, split, start, load_end, end, first, n_tiles


@triton.jit
def _tile_rows(mask_ptr, b, sm_b, start, load_end, end, first, i, BT: tl.constexpr, HAS_MASK: tl.constexpr,
               MASK_WORDS: tl.constexpr, HAS_FIRST: tl.constexpr, LOAD_R: tl.constexpr):
    """Token rows t [BT] of tile ``i``, which of them are loaded (before ``load_end``) and which are attended
    (before ``end``, from ``first`` on and kv_mask != 0: what the softmax keeps). The K/V loads do not wait for the
    mask, so masked rows that are loaded (the caches write every row up to their length) weigh 0."""
    t = start + i * BT + tl.arange(0, BT)
    inb = t < load_end
    attend = inb
    if LOAD_R:
        attend = t < end
    if HAS_MASK and MASK_WORDS:  # kv_mask as int32 words of 4 token bytes (one 4-byte load per token)
        w = tl.load(mask_ptr.to(tl.pointer_type(tl.int32)) + b * sm_b + t // 4, mask=inb, other=0)
        attend = attend & (((w >> ((t % 4) * 8)) & 0xFF) != 0)
    elif HAS_MASK:  # kv_mask [B, T] (uint8, 0 = masked): left padding, finished rows
        attend = attend & (tl.load(mask_ptr + b * sm_b + t, mask=inb, other=0) != 0)
    if HAS_FIRST:
        attend = attend & (t >= first)
    return t, inb, attend


@triton.jit
def _exp(x, BASE2: tl.constexpr, ASM: tl.constexpr):
    """e**x, or 2**x for BASE2 (on the GPU one ``ex2.approx.ftz``: results below 2**-126 flush to 0)."""
    if not BASE2:
        return tl.exp(x)
    elif ASM:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _online_softmax(s, tmask, m_i, l_i, BASE2: tl.constexpr = False, ASM: tl.constexpr = False):
    """Scores s [GP, BT] (fp32) of one tile -> (weights p [GP, BT], rescale alpha [GP], new max, new sum).
    BASE2: s is in units of log2 (scores * log2(e)) and p = 2**(s - max)."""
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile adds nothing
    alpha = _exp(m_i - m_safe, BASE2, ASM)
    p = _exp(s - m_safe[:, None], BASE2, ASM)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _query_rows(q_ptr, b, h, sq_b, sq_h, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """(q [GP, D] of KV head h's G query heads (rows past G zero), g, their mask, d, and the online softmax's
    initial max, sum and accumulator)."""
    g = tl.arange(0, GP)
    gmask = g < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (h * G + g)[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)
    return (q, g, gmask, d, tl.full([GP], float("-inf"), tl.float32), tl.zeros([GP], tl.float32),
            tl.zeros([GP, D], tl.float32))


@triton.jit
def _store_ml(ml_ptr, row, gmask, m_i, l_i):
    """ml[row] = (max, sum) of this split's scores."""
    tl.store(ml_ptr + row * 2, m_i, mask=gmask)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)
