"""Triton FP4-weight grouped GEMM (W4A16) for MoE decode on Hopper.

Program (n-tile, expert): for each tile of the expert's tokens, ``acc[n, t] += W'[n, k] @ x^T[k, t]``
with W' dequantized in registers from the packed codes (streamed through a ``num_stages`` cp.async
pipeline, 16-byte loads) and the block scales, then ``y[t, n] = acc * 2**62 / S_enc``. Weights are the
MMA's M side (swap-AB, wgmma with A from registers), so a decode step with 1..16 tokens per expert still
uses a 64-wide MMA and reads each weight byte once. One extra program row (expert index E) zeroes the
rows past ``offs[-1]``, so the output needs no separate zero fill. When few experts have tokens (decode at batch
1-4), ``moe_slices`` splits K over programs and launches only a few programs that take the active experts' items
in turn (same sums per output, the same bits).

Dequantization: a code ``s e1 e0 m`` placed as bf16 bits ``(code & 7) << 6 | (code & 8) << 12`` is exactly
``value * 2**-126``. The codes are read as uint16 groups of 4 (code 4c+q in nibble q); two groups share a
32-bit register 16 bits apart, so code q of both becomes one bf16x2 word with a mask, a multiply (two
disjoint shifted copies) and a mask, and one ``mul.bf16x2`` applies the block scale (pre-multiplied by
2**64, exact): ``W' = value * scale * 2**-62`` stays normal. That is 13 integer ops + 4 bf16x2 multiplies
per 8 codes (``DEQ_ASM``: inline PTX, elementwise per group, so correct in any register layout; else the
same values from Triton ops, for the CPU interpreter). The tile becomes 4 operands ``W'[:, 4c + q]``
(4 MMAs of K/4), and the activation tile is split the same way (``_split_x``) instead of shuffling weights.
MXFP4 exponents outside [-63, 63] over/underflow in this path (real weights sit far inside).

join_k (large token tiles): the MMAs of one K step are settled before the next step dequantizes (``_settled``).
Triton 3.6 otherwise keeps them in flight while the next step overwrites their weight registers
(triton-lang/triton#9433): about one launch in twenty gave a 2-3% error on the H200 (session 9).
"""

from __future__ import annotations

import math
import statistics

import torch
import triton
import triton.language as tl

from ..formats.tensor import FP4Tensor
from . import moe_slices
from . import triton_fp4 as f
from .dispatch import cdiv, next_pow2
from .moe import check_grouped_args, gpu_activations

# Elementwise over uint16 code groups (4 codes each), two per register ($4); $5: their two bf16 scales.
# Out $q = bf16x2 of code q of each group (16 bits apart in $4) times its scale.
_DEQ_PTX = tl.constexpr(
    "{ .reg .b32 r2, t; shr.b32 r2, $4, 8; "
    "and.b32 t, $4, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $0, t, $5; "
    "and.b32 t, $4, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $1, t, $5; "
    "and.b32 t, r2, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $2, t, $5; "
    "and.b32 t, r2, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $3, t, $5; }"
)
_TWO_POW_64 = tl.constexpr(18446744073709551616.0)
_TWO_POW_62 = tl.constexpr(4611686018427387904.0)


@triton.jit
def _code_bf16(u, s, Q: tl.constexpr):
    """Code Q of each uint16 group -> bf16 value * 2**-126 * s, computed on fp32 bits (exact; Triton's
    interpreter has no bf16 arithmetic and flushes bf16 subnormals)."""
    c = (u.to(tl.uint32) >> (4 * Q)) & 0xF
    bits = ((c & 7) << 22) | ((c & 8) << 28)  # fp32 bits of the bf16 pattern (c & 7) << 6 | (c & 8) << 12
    return (bits.to(tl.float32, bitcast=True) * s.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dequant(u, s, DEQ_ASM: tl.constexpr):
    """uint16 code groups [BN, BK/4] and bf16 scales [BN, BK/4] -> 4 bf16 [BN, BK/4]: W'[:, 4c + q], q = 0..3."""
    if DEQ_ASM:
        return tl.inline_asm_elementwise(_DEQ_PTX, "=r,=r,=r,=r,r,r", [u, s],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=2)
    else:
        return _code_bf16(u, s, 0), _code_bf16(u, s, 1), _code_bf16(u, s, 2), _code_bf16(u, s, 3)


@triton.jit
def _settled(acc, ASM: tl.constexpr):
    """acc itself, after its MMAs completed. Triton 3.6 keeps the MMAs of a loop iteration in flight into the next
    when the weights operand comes from registers, and the next iteration's dequantization may then overwrite
    those registers before the MMAs read them (triton-lang/triton#9433; fixed in later Triton by #9514). An
    (empty) inline asm reading acc makes Triton wait for them at the end of each iteration; it emits no
    instruction."""
    if ASM:
        return tl.inline_asm_elementwise("", "=r,0", [acc], dtype=tl.float32, is_pure=False, pack=1)
    else:
        return acc


@triton.jit
def _mma_order(v, R: tl.constexpr, C: tl.constexpr):
    """[R, C] in memory order -> column c = 16g + 8h + 2t + p holds memory column 16g + 4t + 2h + p.

    An MMA k16 step gives each thread the columns {2t, 2t+1, 2t+8, 2t+9}: after this permutation those are
    4 consecutive code groups (16 codes, one NVFP4 block), so a thread converts half as many block scales."""
    return v.reshape(R, C // 16, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(R, C)


@triton.jit
def _split_x(xt, BT: tl.constexpr, BK: tl.constexpr):
    """x tile [BT, BK] -> x_q [BK/4, BT] = x[:, 4m(c) + q]^T for q = 0..3 (the K order of ``_dequant`` on
    ``_mma_order`` code groups: group column c holds memory group m(c))."""
    xg = xt.reshape(BT, BK // 64, 4, 2, 2, 4).permute(0, 1, 3, 2, 4, 5)  # [t, g, h, tt, p, q]
    x01, x23 = tl.split(xg.reshape(BT, BK // 4, 2, 2).permute(0, 1, 3, 2))  # [t, c, q%2, q//2] -> q//2
    x0, x1 = tl.split(x01)
    x2, x3 = tl.split(x23)
    return tl.trans(x0), tl.trans(x1), tl.trans(x2), tl.trans(x3)


@triton.jit
def _scale_f32(sc, FMT: tl.constexpr):
    """Block scale bytes -> fp32 scale * 2**64 (exact, and exact in bf16)."""
    if FMT == f.NVFP4:
        return sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _TWO_POW_64
    else:
        return ((sc.to(tl.int32) + 64) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _column_scale(g):
    """2**62 / S_enc for NVFP4 global amax ``g`` (undoes the 2**64 scale offset and the encode scale): one division
    (2**62 times RN(1 / S_enc) is one ulp off it where 1 / S_enc is an fp32 subnormal: S_enc >= 2**126; the same
    bits elsewhere)."""
    return tl.div_rn(tl.full(g.shape, 1.0, tl.float32) * _TWO_POW_62, f.nvfp4_encode_scale(g))


@triton.jit
def _token_rows(t0, BT: tl.constexpr, WIDE: tl.constexpr):
    """Token rows t0 + [0, BT): int64 when ``WIDE`` (row x stride may pass 2**31 elements), else int32."""
    rt = t0 + tl.arange(0, BT)
    if WIDE:
        rt = rt.to(tl.int64)
    return rt


@triton.jit
def _row_bound(off, T):
    """An entry of offs clamped to [0, T] (int32): offs is not checked on the host (a host sync), so that bad values
    (past T, negative) cannot make the kernel read x or write y outside their T rows."""
    return tl.minimum(tl.maximum(off, 0), T).to(tl.int32)


@triton.jit
def _zero_tail(y_ptr, offs_ptr, T, N, E, stride_yt, rn, nmask, BT: tl.constexpr, WIDE: tl.constexpr):
    """Rows offs[E-1]..T of y (tokens no expert owns) <- 0."""
    t0 = _row_bound(tl.load(offs_ptr + E - 1), T)
    while t0 < T:  # (a while loop: Triton's interpreter cannot range() over loaded scalars)
        rt = _token_rows(t0, BT, WIDE)
        tl.store(y_ptr + rt[None, :] * stride_yt + rn[:, None], tl.zeros([rn.shape[0], BT], y_ptr.dtype.element_ty),
                 mask=(rt < T)[None, :] & nmask[:, None])
        t0 += BT


@triton.jit
def _expert_tile(x_ptr, wq_ptr, ws_ptr, g_ptr, y_ptr, e, start, end, pid_n, k0,
                 N, K, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
                 FMT: tl.constexpr, B: tl.constexpr, G_MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 BT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DEQ_ASM: tl.constexpr,
                 KS_TILES: tl.constexpr, JOIN_K: tl.constexpr, DOT_F32: tl.constexpr, WIDE: tl.constexpr):
    """y[start:end, tile pid_n] = x[start:end] @ W_e[tile, k0 : k0 + KS_TILES x BK]^T (times the column scale)."""
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = (rn < N) | EVEN_N  # (EVEN_N: N % BN == 0, no row masks on the weight loads)
    wrow = wq_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn  # [BN, 1] uint16 code groups
    srow = ws_ptr + e.to(tl.int64) * stride_se + rn[:, None] * stride_sn
    if G_MODE == 1:
        col = _column_scale(tl.load(g_ptr))
    elif G_MODE == 2:
        col = _column_scale(tl.load(g_ptr + e.to(tl.int64) * N + rn, mask=nmask, other=1.0))[:, None]
    else:
        col = _TWO_POW_62
    for_dot: tl.constexpr = tl.float32 if DOT_F32 else tl.bfloat16
    t0 = start
    while t0 < end:
        rt = _token_rows(t0, BT, WIDE)
        tmask = rt < end
        acc = tl.zeros([BN, BT], tl.float32)
        for kt in range(0, KS_TILES):  # constexpr trip count (also what the interpreter can range over)
            k = k0 + kt * BK
            kw = k // 4 + tl.arange(0, BK // 4)[None, :]
            ks = k // B + tl.arange(0, BK // B)[None, :]
            kx = k + tl.arange(0, BK)[None, :]
            if EVEN_K and EVEN_N:
                u = tl.load(wrow + kw)
                sc = tl.load(srow + ks)
                xt = tl.load(x_ptr + rt[:, None] * stride_xt + kx, mask=tmask[:, None], other=0.0)
            elif EVEN_K:
                u = tl.load(wrow + kw, mask=nmask[:, None], other=0)
                sc = tl.load(srow + ks, mask=nmask[:, None], other=0)
                xt = tl.load(x_ptr + rt[:, None] * stride_xt + kx, mask=tmask[:, None], other=0.0)
            else:
                u = tl.load(wrow + kw, mask=nmask[:, None] & (kw < K // 4), other=0)
                sc = tl.load(srow + ks, mask=nmask[:, None] & (ks < K // B), other=0)
                xt = tl.load(x_ptr + rt[:, None] * stride_xt + kx, mask=tmask[:, None] & (kx < K), other=0.0)
            s = _scale_f32(sc, FMT).to(tl.bfloat16)  # [BN, BK/B] (exact) -> one per code group [BN, BK/4]
            s = tl.broadcast_to(s[:, :, None], [BN, BK // B, B // 4]).reshape(BN, BK // 4)
            prec: tl.constexpr = "ieee" if DOT_F32 else "tf32"  # (bf16 operands ignore it)
            if JOIN_K:  # one MMA chain over BK: W' back in K order (register repacking), x as loaded
                w0, w1, w2, w3 = _dequant(u, s, DEQ_ASM)
                w = tl.join(tl.join(w0, w2), tl.join(w1, w3)).reshape(BN, BK)  # [.., c, q] -> K = 4c + q
                acc = _settled(tl.dot(w.to(for_dot), tl.trans(xt).to(for_dot), acc, input_precision=prec), not DOT_F32)
            else:  # 4 MMAs of BK/4 on the dequant's own order: no weight repacking (decode)
                w0, w1, w2, w3 = _dequant(_mma_order(u, BN, BK // 4), _mma_order(s, BN, BK // 4), DEQ_ASM)
                x0, x1, x2, x3 = _split_x(xt, BT, BK)
                acc = tl.dot(w0.to(for_dot), x0.to(for_dot), acc, input_precision=prec)
                acc = tl.dot(w1.to(for_dot), x1.to(for_dot), acc, input_precision=prec)
                acc = tl.dot(w2.to(for_dot), x2.to(for_dot), acc, input_precision=prec)
                acc = tl.dot(w3.to(for_dot), x3.to(for_dot), acc, input_precision=prec)
        out = acc * col
        tl.store(y_ptr + rt[None, :] * stride_yt + rn[:, None], out.to(y_ptr.dtype.element_ty),
                 mask=tmask[None, :] & nmask[:, None])
        t0 += BT


@triton.jit
def fp4_gemm_kernel(
    x_ptr, wq_ptr, ws_ptr, g_ptr, y_ptr, offs_ptr,
    T, N, K, E, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
    FMT: tl.constexpr, B: tl.constexpr, G_MODE: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    DEQ_ASM: tl.constexpr,
    K_TILES: tl.constexpr, JOIN_K: tl.constexpr, DOT_F32: tl.constexpr, WIDE: tl.constexpr = False,
    K_SLICES: tl.constexpr = 1, stride_ys=0, COMPACT: tl.constexpr = False, EP2: tl.constexpr = 1,
    N_TILES: tl.constexpr = 1, PROGRAMS=1,
):
    """y[offs[e-1]:offs[e]] = x[...] @ W_e^T for W_e packed FP4 [N, K] (codes read as uint16 groups of 4).
    WIDE: token offsets in int64 (a prefill of T rows with T x row stride >= 2**31 elements).
    K_SLICES > 1: a (n-tile, expert, slice) item sums K tiles [slice, slice + 1) x K_TILES / K_SLICES and writes its
    fp32 partial to y + slice x stride_ys (``moe_slices``: the partials are summed in slice order after).
    Grid: (n-tile, expert (+ 1: the zero tail), slice), or with COMPACT (``moe_slices``) PROGRAMS programs that take
    the items of the experts with tokens in turn (+ N_TILES programs for the zero tail when K_SLICES == 1)."""
    ks_tiles: tl.constexpr = K_TILES // K_SLICES
    if COMPACT:
        pid = tl.program_id(0)
        if pid >= PROGRAMS:
            rn = (pid - PROGRAMS) * BN + tl.arange(0, BN)
            _zero_tail(y_ptr, offs_ptr, T, N, E, stride_yt, rn, (rn < N) | EVEN_N, BT, WIDE)
            return
        ex = tl.arange(0, EP2)
        ends = _row_bound(tl.load(offs_ptr + ex, mask=ex < E, other=0), T)
        starts = _row_bound(tl.load(offs_ptr + ex - 1, mask=(ex > 0) & (ex < E), other=0), T)
        active = ends > starts
        rank = tl.cumsum(active.to(tl.int32), 0) - 1  # among the experts with tokens
        per_expert: tl.constexpr = N_TILES * K_SLICES
        items = tl.sum(active.to(tl.int32), 0) * per_expert
        item = pid
        while item < items:
            a = item // per_expert
            sel = active & (rank == a)
            r = item - a * per_expert
            pid_n = r // K_SLICES
            sl = r - pid_n * K_SLICES
            _expert_tile(x_ptr, wq_ptr, ws_ptr, g_ptr, y_ptr + sl * stride_ys, tl.sum(tl.where(sel, ex, 0), 0),
                         tl.sum(tl.where(sel, starts, 0), 0), tl.sum(tl.where(sel, ends, 0), 0), pid_n,
                         sl * (ks_tiles * BK), N, K, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                         stride_yt, FMT, B, G_MODE, BN, BK, BT, EVEN_K, EVEN_N, DEQ_ASM, ks_tiles, JOIN_K, DOT_F32,
                         WIDE)
            item += PROGRAMS
    else:
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        if K_SLICES == 1:
            k0 = 0
        else:
            k0 = tl.program_id(2) * (ks_tiles * BK)
            y_ptr += tl.program_id(2) * stride_ys
        if e == E:
            rn = pid_n * BN + tl.arange(0, BN)
            _zero_tail(y_ptr, offs_ptr, T, N, E, stride_yt, rn, (rn < N) | EVEN_N, BT, WIDE)
            return
        start = _row_bound(tl.load(offs_ptr + tl.maximum(e - 1, 0), mask=e > 0, other=0), T)
        end = _row_bound(tl.load(offs_ptr + e), T)
        _expert_tile(x_ptr, wq_ptr, ws_ptr, g_ptr, y_ptr, e, start, end, pid_n, k0, N, K, stride_xt, stride_we,
                     stride_wn, stride_se, stride_sn, stride_yt, FMT, B, G_MODE, BN, BK, BT, EVEN_K, EVEN_N, DEQ_ASM,
                     ks_tiles, JOIN_K, DOT_F32, WIDE)


# (max average tokens per expert, (BN, BK, BT, num_warps, num_stages[, join_k[, max_registers]]), PTX dequant):
# the first row that fits. BN x BK: weight tile per K step (BK >= 64, clipped to K), BT: token tile, join_k: one MMA
# chain over BK with the weights repacked to K order (large token tiles) instead of 4 MMAs of BK/4 (decode),
# max_registers: a register cap. The winners of `python3 benchmarks/bench_moe_gemm.py --sweep` on the H200
# (device time; 2026-12-01, session 9): the 16 row at 1-16 tokens per expert on all three shapes (register caps
# and BN 256 were slower), the 64 row at 64 on all three; at 256, join_k (its MMAs settled per K step) and the
# same tile without it were within 2-7% of each other (the 128 row was not timed at 128).
CONFIGS = (
    (16, (128, 128, 16, 4, 4), True),
    (32, (128, 128, 32, 4, 4), True),
    (64, (128, 128, 64, 8, 4), True),
    (128, (128, 128, 128, 8, 3), True),
    (1 << 30, (128, 64, 256, 8, 3, True), True),
)
DEQ_ASM_DEFAULT = True
"""Dequantize with inline PTX (else Triton ops) when a ``config`` is given without ``deq_asm``."""


BUSIEST_EXPERT = True
"""``default_config`` picks the row of ``CONFIGS`` for about the busiest expert's token count (``busiest_tokens``), not
the mean: a program re-reads and dequantizes its expert's weights for every token tile, and the kernel lasts as long
as its busiest program. Under random top-8 routing (``benchmarks/bench_moe_skew.py``, H200) the mean's tile took
1.3x longer at 16 tokens per expert on the mean (busiest 22-25: two passes of the 16-token tile). Off: the mean."""


def busiest_tokens(tokens: int, experts: int) -> float:
    """About the most tokens one of ``experts`` gets when ``tokens`` rows are routed uniformly: the median of the
    maximum with Poisson counts and a normal tail, mean + z sqrt(mean) with P(N(0, 1) > z) = ln 2 / experts."""
    mean = tokens / max(experts, 1)
    z = statistics.NormalDist().inv_cdf(1.0 - math.log(2.0) / experts) if experts > 1 else 0.0
    return mean + max(z, 0.0) * math.sqrt(mean)


def default_config(tokens: int, experts: int, k: int) -> tuple[tuple, bool]:
    """``pick_config`` for ``tokens`` rows over ``experts`` experts (host values: no sync): for the busiest expert
    (``BUSIEST_EXPERT``) while that fits the decode rows' tiles (<= 64 tokens, where it was measured), else for the
    mean (every program loops over several tiles anyway)."""
    mean = tokens / max(experts, 1)
    busiest = busiest_tokens(tokens, experts)
    return pick_config(busiest if BUSIEST_EXPERT and busiest <= 64 else mean, k)


def pick_config(avg_tokens: float, k: int, configs=CONFIGS) -> tuple[tuple, bool]:
    """((BN, BK, BT, num_warps, num_stages[, join_k[, max_registers]]), deq_asm) for ``avg_tokens`` tokens per
    expert on average."""
    for limit, cfg, asm in configs:
        if avg_tokens <= limit:
            bn, bk, *rest = cfg
            return (bn, min(bk, max(64, next_pow2(k))), *rest), asm
    raise AssertionError("CONFIGS must end with an unbounded row")


def check_config(config) -> tuple[int, int, int, int, int, bool, int | None]:
    """(BN, BK, BT, num_warps, num_stages, join_k, max_registers) of a launch config (join_k and max_registers
    optional; max_registers 0 or None: no cap); named errors for what cannot compile."""
    if len(config) not in (5, 6, 7):
        raise ValueError(f"config={config!r} must be (BN, BK, BT, num_warps, num_stages[, join_k[, max_registers]])")
    bn, bk, bt, nw, ns, *rest = config
    join, maxreg = (list(rest) + [False, None])[:2]
    for name, v, lo in (("BN", bn, 16), ("BK", bk, 64), ("BT", bt, 16)):
        if v < lo or v & (v - 1):
            raise ValueError(f"config {name}={v} must be a power of two >= {lo}")
    if nw not in (1, 2, 4, 8, 16) or not 1 <= ns <= 8:
        raise ValueError(f"config num_warps={nw} must be 1..16 (power of two), num_stages={ns} 1..8")
    if maxreg and not 24 <= maxreg <= 255:
        raise ValueError(f"config max_registers={maxreg} must be 24..255 (or 0: no cap)")
    return bn, bk, bt, nw, ns, bool(join), maxreg or None


WIDE_ELEMENTS = 2**31
"""From this many elements of x or y (rows x row stride) the kernel computes token offsets in int64 (``WIDE``): an
int32 row x stride product would wrap (a Qwen3-30B-A3B-shaped prefill of 64 x 8192 tokens, 4.2M routed rows of
2048, gave an illegal memory access on the H200, session 14)."""


def launch_spec(t: int, weight, config, deq_asm: bool, stride_xt: int, stride_yt: int, k_slices: int = 1,
                programs: int = 0):
    """(scalar args, grid, constexprs + launch options) of ``fp4_gemm_kernel`` for ``t`` tokens and a contiguous
    FP4Tensor-like ``weight`` (shape, fmt, block_size, global_amax); shared with the benchmark's precompile.
    ``k_slices`` > 1: the grid's K slices (``moe_slices``), y then the fp32 workspace [k_slices, t, N].
    ``programs`` > 0: that many programs take the items of the experts with tokens in turn (``COMPACT``)."""
    e, n, k = weight.shape
    bs = weight.block_size
    bn, bk, bt, nw, ns, join_k, maxreg = check_config(config)
    k_tiles, n_tiles = cdiv(k, bk), cdiv(n, bn)
    g = weight.global_amax
    scalars = (t, n, k, e, stride_xt, n * k // 4, k // 4, n * k // bs, k // bs, stride_yt)
    meta = dict(FMT=0 if weight.fmt == "nvfp4" else 1, B=bs, G_MODE=0 if g is None else (1 if g.dim() == 0 else 2),
                BN=bn, BK=bk, BT=bt, EVEN_K=k % bk == 0, EVEN_N=n % bn == 0, DEQ_ASM=deq_asm,
                K_TILES=k_tiles, JOIN_K=join_k, DOT_F32=False, K_SLICES=k_slices, COMPACT=programs > 0,
                EP2=next_pow2(e), N_TILES=n_tiles, PROGRAMS=max(programs, 1),
                WIDE=(t + bt) * max(stride_xt, stride_yt) >= WIDE_ELEMENTS, num_warps=nw, num_stages=ns,
                **({"maxnreg": maxreg} if maxreg else {}))
    if k_slices > 1:
        moe_slices.check_k_slices(k_slices, k_tiles)
        if meta["WIDE"] or k_slices * (t + bt) * n >= WIDE_ELEMENTS:
            raise ValueError(f"k_slices={k_slices} needs a workspace of fewer than 2**31 elements (t={t}, N={n}): "
                             "use k_slices=1 for long prefills")
        meta["stride_ys"] = t * n
    tail = n_tiles if k_slices == 1 else 0  # (sliced: the sum zeroes the rows past offs[-1])
    if programs > 0:
        return scalars, (programs + tail,), meta
    return scalars, (n_tiles, e + (tail > 0), k_slices), meta  # grid row e == E: zero the rows past offs[-1]


def grouped_mm(x, weight: FP4Tensor, offs: torch.Tensor, *, out_dtype: torch.dtype | None = None,
               config: tuple | None = None, deq_asm: bool | None = None, k_slices: int | None = None,
               programs: int | None = None) -> torch.Tensor:
    """W4A16 grouped GEMM (see the module docstring). ``config`` ((BN, BK, BT, num_warps, num_stages[, join_k]))
    and ``deq_asm`` override ``CONFIGS``; ``k_slices`` (a divisor of the config's K tiles) and ``programs`` (0: one
    program per (tile, expert, slice); > 0: that many programs over the experts with tokens) override
    ``launch_defaults`` (for few active experts).

    The config and the slices are chosen from x's rows and the expert count, so no host sync is needed; for the same
    reason ``offs`` is not checked (``grouped_mm_reference`` raises for bad values): entries outside [0, T] act as
    clamped to it, so they never make the kernel read x or write y outside their rows.
    """
    xd = gpu_activations(x)  # (bf16; W4A4 emulation: FP4 activations dequantized first)
    e, n, k = check_grouped_args(xd, weight, offs)
    out_dtype = out_dtype or xd.dtype
    t = xd.shape[0]
    if t == 0:
        return torch.zeros(t, n, dtype=out_dtype, device=xd.device)
    y = torch.empty(t, n, dtype=out_dtype, device=xd.device)  # the kernel writes every row
    picked, picked_asm = default_config(t, e, k)
    use_asm = (picked_asm if config is None else DEQ_ASM_DEFAULT) if deq_asm is None else deq_asm
    words = weight.codes.contiguous().view(torch.uint16)  # [E, N, K/4] groups of 4 codes (code 4c+q: nibble q)
    scales = weight.block_scales.contiguous().view(torch.uint8)  # [E, N, K/B]
    g = weight.global_amax
    g_arg = scales if g is None else g.float().contiguous()
    cfg = config or picked
    k_slices, programs = launch_defaults(t, e, n, k, cfg, xd.device, k_slices, programs)
    scalars, grid, meta = launch_spec(t, weight, cfg, use_asm, xd.stride(0), y.stride(0), k_slices, programs)
    meta["DOT_F32"] = not xd.is_cuda  # Triton's CPU interpreter: fp32 dots (it multiplies bf16 as raw bits)
    if not xd.is_cuda:
        meta.pop("maxnreg", None)  # (a compiler option)
    if k_slices == 1:
        fp4_gemm_kernel[grid](xd, words, scales, g_arg, y, offs, *scalars, **meta)
        return y
    ws = torch.empty(k_slices, t, n, dtype=torch.float32, device=xd.device)
    fp4_gemm_kernel[grid](xd, words, scales, g_arg, ws, offs, *scalars, **meta)
    return moe_slices.sum_slices(ws, y, offs)


AUTO_K_SLICES = True
"""``grouped_mm`` slices K by ``moe_slices.default_k_slices`` when no ``k_slices`` is given (else 1). Off: one
program per (column tile, expert), as before session 15."""
COMPACT = True
"""``grouped_mm`` runs the ``COMPACT`` grid (``moe_slices.compact_programs`` programs over the experts with tokens)
where ``moe_slices.few_active`` and no ``programs`` is given; off: a program per (column tile, expert, slice)."""


def launch_defaults(t: int, e: int, n: int, k: int, config: tuple, device: torch.device, k_slices: int | None = None,
                    programs: int | None = None) -> tuple[int, int]:
    """(k_slices, programs) of ``grouped_mm`` for ``t`` routed rows over ``e`` experts, ``config``'s tiles, those
    given kept: the grid first (compact where few experts are active, or as ``programs`` says), then the slices for
    that grid (1 where the workspace would pass int32 offsets), then the compact grid's program count."""
    bn, bk, bt = config[:3]
    compact = (COMPACT and moe_slices.few_active(t, e)) if programs is None else programs > 0
    if k_slices is None:
        k_slices = 1
        if AUTO_K_SLICES and moe_slices.MAX_K_SLICES * (t + bt) * max(n, k) < WIDE_ELEMENTS:
            k_slices = moe_slices.default_k_slices(t, e, cdiv(n, bn), cdiv(k, bk), device, compact)
    if programs is None:
        programs = moe_slices.compact_programs(e, cdiv(n, bn) * k_slices, device) if compact else 0
    return k_slices, programs
