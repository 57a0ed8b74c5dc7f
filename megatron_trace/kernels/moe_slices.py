"""K slices and the compact grid of the W4A16 grouped GEMM, for few active experts (decode at small batch).

A program of ``moe_triton.fp4_gemm_kernel`` holds one (column tile, expert) and streams the expert's whole K. At batch
1 of a 128-expert top-8 model only 8 experts have tokens: 8 x 12 column tiles of 128 are 96 programs of 4 warps for
132 multiprocessors, one warp per scheduler with nothing to hide its latency (0.12 of copy bandwidth, session 14).
With ``k_slices`` = S the grid gets a third axis: program (tile, expert, s) streams K tiles [s, s + 1) x K_TILES / S
and writes its fp32 partial to a workspace [S, T, N]; ``slice_sum_kernel`` then adds the S partials of each output in
slice order (deterministic: the same bits on every launch, no atomics) and zeroes the rows no expert owns.

The full grid has a program per (column tile, expert, slice), and at batch 1 all but 8 of 128 experts' programs
only read their offsets and exit: 1536-12288 programs churn through the multiprocessors' slots. The COMPACT grid
(``compact_programs``) launches a few programs per multiprocessor that each rank the experts with tokens and take
their (expert, column tile, slice) items in turn; every item computes what the full grid's program computes, so the
bits are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import cdiv, sm_count

MAX_K_SLICES = 8
"""At most this many slices, each at least ``MIN_TILES_PER_SLICE`` K tiles (the cp.async pipeline needs a few)."""
MIN_TILES_PER_SLICE = 2
MIN_TILES_PER_SLICE_FULL = 4
"""On the full grid a slice also multiplies the programs that exit at once: there slices hold at least this many K
tiles (session 15: Qwen3 fc2's 6 tiles in 2 slices were 7-13% slower than 1 at batch 2-4 on the full grid, and in 3
slices 11% faster at batch 1 on the compact grid)."""
PROGRAMS_PER_SM = 4
"""``default_k_slices`` slices until the expected programs with tokens reach this many per multiprocessor."""
COMPACT_ACTIVE_SHARE = 1 / 8
"""The COMPACT grid up to this share of experts with tokens (session 15, H200, Qwen3-30B-A3B shapes under random
routing: at batch 1 (8 of 128 experts) it took fc1 from 21.6 to 16.9 us with 8 K slices and fc2 from 14.4 to 10.2 us
with 3; from batch 4 (29 of 128) on the full grid was 3-40% faster: its idle programs cost less than the compact
programs' serial items)."""
SUM_BLOCK = 1024


@triton.jit
def slice_sum_kernel(ws_ptr, y_ptr, offs_ptr, TN, N, E, S: tl.constexpr, BLOCK: tl.constexpr):
    """y.flat[i] = sum over s (in order) of ws[s].flat[i] for rows before offs[E-1], else 0 (i < TN = T x N)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    owned = (i < tl.load(offs_ptr + E - 1).to(tl.int64) * N) & (i < TN)  # (offs[E-1] may pass T: not checked)
    acc = tl.load(ws_ptr + i, mask=owned, other=0.0)
    for s in range(1, S):
        acc += tl.load(ws_ptr + s * TN + i, mask=owned, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=i < TN)


def sum_slices(ws: torch.Tensor, y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``y`` [T, N] (contiguous) <- the sum of the partials ``ws`` [S, T, N] fp32, rows past ``offs[-1]`` zeroed."""
    s, t, n = ws.shape
    slice_sum_kernel[(cdiv(t * n, SUM_BLOCK),)](ws, y, offs, t * n, n, offs.numel(), S=s, BLOCK=SUM_BLOCK)
    return y


def expected_active(rows: int, experts: int) -> float:
    """Expected experts with at least one of ``rows`` routed rows, each routed to a uniform random expert."""
    return experts * (1.0 - (1.0 - 1.0 / experts) ** rows) if experts > 1 else float(rows > 0)


def check_k_slices(k_slices: int, k_tiles: int) -> int:
    """``k_slices`` if it divides the K tiles (``k_tiles`` = cdiv(K, BK)) into equal slices; else a named error."""
    if not isinstance(k_slices, int) or k_slices < 1 or k_tiles % k_slices:
        divisors = [d for d in range(1, k_tiles + 1) if k_tiles % d == 0]
        raise ValueError(f"k_slices={k_slices!r} must divide the {k_tiles} K tiles of the config: one of {divisors}")
    return k_slices


def pick_k_slices(programs: float, k_tiles: int, sms: int, min_tiles: int = MIN_TILES_PER_SLICE) -> int:
    """The fewest slices (a divisor of ``k_tiles``, at most ``MAX_K_SLICES``, each at least ``min_tiles`` tiles)
    that bring ``programs`` (with tokens, per slice) to ``PROGRAMS_PER_SM`` x ``sms``; else the most allowed."""
    best = 1
    for s in range(1, min(MAX_K_SLICES, k_tiles // min_tiles) + 1):
        if k_tiles % s == 0:
            best = s
            if programs * s >= PROGRAMS_PER_SM * sms:
                break
    return best


def few_active(rows: int, experts: int) -> bool:
    """At most ``COMPACT_ACTIVE_SHARE`` of ``experts`` expected to get some of ``rows`` routed rows."""
    return expected_active(rows, experts) <= COMPACT_ACTIVE_SHARE * experts


def compact_programs(experts: int, items_per_expert: int, device: torch.device) -> int:
    """Programs of the ``COMPACT`` grid on ``device``: ``PROGRAMS_PER_SM`` per multiprocessor, at most one per
    (expert, column tile, slice) item; 0 (the full grid) off CUDA. ``few_active`` says where it pays."""
    if device.type != "cuda":
        return 0
    return min(experts * items_per_expert, PROGRAMS_PER_SM * sm_count(device))


def default_k_slices(rows: int, experts: int, n_tiles: int, k_tiles: int, device: torch.device, compact: bool) -> int:
    """``pick_k_slices`` for ``rows`` routed rows over ``experts`` (the expected active ones) x ``n_tiles`` column
    tiles on ``device``'s multiprocessors, on the compact grid or the full one (``MIN_TILES_PER_SLICE_FULL``); 1 off
    CUDA. Host values only: no sync."""
    if device.type != "cuda":
        return 1
    return pick_k_slices(expected_active(rows, experts) * n_tiles, k_tiles, sm_count(device),
                         MIN_TILES_PER_SLICE if compact else MIN_TILES_PER_SLICE_FULL)
