"""Grouped GEMM of the routed experts: ``torch._grouped_mm`` on CUDA (bf16), a per-expert loop elsewhere.

Both compute ``y[rows of e] = x[rows of e] @ w[e].T`` for rows sorted by expert. The loop is
the reference; ``grouped_mm`` is the fast path and is tested against it where torch supports it.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

GEMM_IMPLS = ("auto", "loop", "grouped_mm")


def to_device_async(t: torch.Tensor, device) -> torch.Tensor:
    """``t.to(device)``; a host tensor goes to a GPU from pinned memory without blocking (a pageable copy
    would wait for the stream: a hidden sync)."""
    device = torch.device(device)
    if device.type == "cuda" and not t.is_cuda:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _counts(tokens_per_expert) -> list[int]:
    """Host row counts; ints >= 0 only (int() took 1.5 as 1 and True as 1: the rows split among other experts)."""
    counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
    bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0]
    if bad:
        raise ValueError(f"tokens_per_expert={counts} holds {bad[0]!r}: row counts are ints >= 0")
    return [int(c) for c in counts]


def grouped_linear_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x [N, K] sorted by expert, w [E, M, K] -> [N, M]. Every expert joins the graph (empty groups too)."""
    outs = [F.linear(xe, w[e]) for e, xe in enumerate(torch.split(x, counts))]
    return torch.cat(outs, 0)


def grouped_linear_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The same with ``torch._grouped_mm`` (offsets = cumulative row counts, int32; copied to the GPU from
    pinned memory without blocking the host)."""
    offs = to_device_async(torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32), x.device)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # cuBLAS grouped GEMM: bf16 operands, 16-byte aligned inner dimensions.
    return (
        hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0
    )


def grouped_linear(x: torch.Tensor, w: torch.Tensor, tokens_per_expert, impl: str = "auto") -> torch.Tensor:
    """x [N, K] rows sorted by expert, w [E, M, K], rows per expert -> [N, M].

    Counts on the GPU stay there on the ``grouped_mm`` path (offsets by cumsum: no host sync; their sum is
    Megatron's row count by construction and is not re-checked); the loop needs them on the host."""
    if impl not in GEMM_IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {GEMM_IMPLS}")
    mm = impl == "grouped_mm" or (impl == "auto" and _grouped_mm_ok(x, w))
    if mm and torch.is_tensor(tokens_per_expert) and tokens_per_expert.device == x.device:
        if tokens_per_expert.numel() != w.shape[0]:
            raise ValueError(f"tokens_per_expert has {tokens_per_expert.numel()} counts for {w.shape[0]} experts")
        offs = tokens_per_expert.reshape(-1).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    counts = _counts(tokens_per_expert)
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"tokens_per_expert={counts} does not fit x rows {x.shape[0]} and {w.shape[0]} experts")
    if mm:
        return grouped_linear_mm(x, w, counts)
    return grouped_linear_loop(x, w, counts)
