"""Merge of the FP4-KV decode attention's split partials (``kv_attention_triton``): each split of T wrote
(acc unnormalised, max, sum); ``combine_kernel`` merges them in one launch per call, ``combine`` is its torch twin."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fp4 as f


def combine(acc: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """Merge split partials: acc [B, Hq, S, D], ml [B, Hq, S, 2] (max, sum) -> [B, Hq, D] fp32 (torch ops; the
    twin of ``combine_kernel``)."""
    m, l_sum = ml[..., 0], ml[..., 1]
    mx = m.amax(-1, keepdim=True)
    w = torch.where(m == float("-inf"), 0.0, torch.exp(m - mx))  # empty splits weigh nothing
    return (acc * w.unsqueeze(-1)).sum(-2) / (l_sum * w).sum(-1, keepdim=True)


@triton.jit
def combine_kernel(acc_ptr, ml_ptr, out_ptr, S, D: tl.constexpr, SP: tl.constexpr):
    """``combine`` of one (batch, query head) row, cast to out's dtype: one launch instead of a dozen torch ops."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    smask = s < S
    m = tl.load(ml_ptr + (row * S + s) * 2, mask=smask, other=float("-inf"))
    l_sum = tl.load(ml_ptr + (row * S + s) * 2 + 1, mask=smask, other=0.0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.max(m, 0)))  # empty splits weigh nothing
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + (row * S + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
    tl.store(out_ptr + row * D + d, f.to_dtype(out, out_ptr.dtype.element_ty))  # RNE also in the interpreter


def combine_splits(acc: torch.Tensor, ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``combine`` in one Triton launch (``combine_kernel``): [B, Hq, D] in ``dtype``."""
    bsz, hq, splits, d = acc.shape
    out = torch.empty(bsz, hq, d, dtype=dtype, device=acc.device)
    combine_kernel[(bsz * hq,)](acc, ml, out, splits, D=d, SP=triton.next_power_of_2(splits), num_warps=4)
    return out
