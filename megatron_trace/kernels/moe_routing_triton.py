"""MoE routing in one Triton launch: the (token, slot) pairs sorted by expert, for small (decode) inputs.

``routing(top_k_index [T, k], E)`` returns what ``rollout.fp4_moe._routing_torch`` returns, bit for bit:

  order  int64 [N]  pair indices (p = token * k + slot) sorted by expert id, stable (``torch.sort(stable=True)``)
  offs   int32 [E]  offs[e] = #{pairs with id <= e} (``torch.searchsorted(right=True)``: ``torch._grouped_mm``'s)
  inv    int64 [N]  order's inverse permutation (inv[order[i]] = i)

with N = T * k, in one program (decode: about 7 us of sort, searchsorted and index_put launches per layer
become one launch). The sort is by comparison ranks, not a counting sort: pair i goes to

  rank_i = #{j : key_j < key_i} + #{j < i : key_j == key_i}

(exactly the position a stable sort gives it), and offs[e] = #{j : key_j <= e}. Both are sums of [BN, BJ] and
[BJ, BE] compare tiles, over chunks of BJ pairs j; then inv[i] = rank_i and order[rank_i] = i (a scatter).
No scan is needed, and any integer ids give torch's result: ids outside [0, E) sort to the ends and count in
offs as searchsorted counts them (the router's top-k never produces them; ``w4a4_experts_forward`` rejects
them, the grouped path does not check, as that would sync). The keys are the ids truncated to int16, as in
the torch path for E <= 2**15 (its 2-byte radix sort; ``fits`` implies E <= 4096), so even ids beyond int16
agree.

Limits (``fits``): with BN, BE the next powers of two of N and E (at least 16), BN * max(BN, BE) <= MAX_WORK
(2**16): at most 16 chunk steps of TILE (4096) compares each, e.g. N <= 256 for E <= 256, or N <= 64 for
E <= 1024. Larger inputs (prefill) go to the torch path; ``routing`` raises for them. Top-k index tensors of
any strides and integer dtype are read in place (no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2

MAX_WORK = 1 << 16
"""Bound on BN * max(BN, BE): the compares one program makes (see the module docstring)."""
TILE = 4096
"""Elements of one compare tile (BN * BJ and BJ * BE): 32 per thread at NUM_WARPS = 4."""
NUM_WARPS = 4
MIN_BLOCK = 16
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _block(n: int) -> int:
    return max(MIN_BLOCK, next_pow2(max(n, 1)))


def fits(n: int, num_experts: int) -> bool:
    """Whether ``routing`` takes N = ``n`` pairs over ``num_experts`` experts (one program, see ``MAX_WORK``)."""
    if n < 0 or num_experts < 1:
        return False
    bn = _block(n)
    return bn * max(bn, _block(num_experts)) <= MAX_WORK


@triton.jit
def _key(ids_ptr, p, mask, K, stride_t, stride_k):
    """The sort keys of pairs p (token p // K, slot p % K): the ids truncated to int16, as int32."""
    key = tl.load(ids_ptr + (p // K) * stride_t + (p % K) * stride_k, mask=mask, other=0)
    return key.to(tl.int16).to(tl.int32)


@triton.jit
def routing_kernel(ids_ptr, order_ptr, offs_ptr, inv_ptr, N, E, K, stride_t, stride_k,
                   BN: tl.constexpr, BE: tl.constexpr, BJ: tl.constexpr):
    """One program: order, offs and inv of N pairs over E experts (BN >= N, BE >= E, BJ pairs j per step)."""
    i = tl.arange(0, BN)  # [BN] pairs i
    e = tl.arange(0, BE)  # [BE] experts
    i_ok = i < N
    key_i = _key(ids_ptr, i, i_ok, K, stride_t, stride_k)
    rank = tl.zeros([BN], dtype=tl.int32)
    offs = tl.zeros([BE], dtype=tl.int32)
    for s in range(BN // BJ):  # a constexpr trip count (the interpreter cannot range over a runtime N)
        j = s * BJ + tl.arange(0, BJ)  # [BJ] pairs j
        j_ok = j < N
        key_j = _key(ids_ptr, j, j_ok, K, stride_t, stride_k)
        kj, ki = key_j[None, :], key_i[:, None]  # [1, BJ], [BN, 1]
        before = ((kj < ki) | ((kj == ki) & (j[None, :] < i[:, None]))) & j_ok[None, :]  # [BN, BJ]
        rank += tl.sum(before.to(tl.int32), axis=1)
        at_most = (key_j[:, None] <= e[None, :]) & j_ok[:, None]  # [BJ, BE]
        offs += tl.sum(at_most.to(tl.int32), axis=0)
    tl.store(offs_ptr + e, offs, mask=e < E)
    tl.store(inv_ptr + i, rank.to(tl.int64), mask=i_ok)
    tl.store(order_ptr + rank, i.to(tl.int64), mask=i_ok)  # ranks are a permutation of 0..N-1


@torch.compiler.disable  # a Triton launch: eager even where a caller is compiled
def routing(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_k_index int [T, k] -> (order int64 [T*k], offs int32 [E], inv int64 [T*k]); one launch, no host sync.

    Raises ``ValueError`` for a non-integer or non-2-D index, ``num_experts < 1``, or an input that does not
    ``fits`` (use the torch path then).
    """
    if top_k_index.dim() != 2 or top_k_index.dtype not in INDEX_DTYPES:
        raise ValueError(f"top_k_index must be an integer [T, k] tensor, got {top_k_index.dtype} "
                         f"{tuple(top_k_index.shape)}")
    tokens, k = top_k_index.shape
    n = tokens * k
    if not fits(n, num_experts):
        raise ValueError(f"routing kernel takes N * max(N, E) <= {MAX_WORK} (powers of two, >= {MIN_BLOCK}) and "
                         f"E >= 1: got N={n} (tokens={tokens}, k={k}), {num_experts=}; use the torch routing")
    dev = top_k_index.device
    order = torch.empty(n, dtype=torch.int64, device=dev)
    inv = torch.empty(n, dtype=torch.int64, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    bn, be = _block(n), _block(num_experts)
    bj = min(bn, max(1, TILE // max(bn, be)))
    routing_kernel[(1,)](top_k_index, order, offs, inv, n, num_experts, max(k, 1), top_k_index.stride(0),
                         top_k_index.stride(1), BN=bn, BE=be, BJ=bj, num_warps=NUM_WARPS)
    return order, offs, inv
