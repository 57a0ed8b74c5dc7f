"""Merge of the FP4-KV decode attention's split partials (``kv_attention_triton``): each split of T wrote
(acc unnormalised, max, sum); ``combine_kernel`` merges them in one launch per call, ``combine`` is its torch twin."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fp4 as f
from .dispatch import next_pow2


def combine(acc: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """Merge split partials: acc [B, Hq, S, D], ml [B, Hq, S, 2] (max, sum) -> [B, Hq, D] fp32 (torch ops; the
    twin of ``combine_kernel``)."""
    m, l_sum = ml[..., 0], ml[..., 1]
    mx = m.amax(-1, keepdim=True)
    w = torch.where(m == float("-inf"), 0.0, torch.exp(m - mx))  # empty splits weigh nothing
    return (acc * w.unsqueeze(-1)).sum(-2) / (l_sum * w).sum(-1, keepdim=True)


@triton.jit
def combine_kernel(acc_ptr, ml_ptr, out_ptr, S, D: tl.constexpr, SP: tl.constexpr, SB: tl.constexpr):
    """``combine`` of one (batch, query head) row, cast to out's dtype: one launch instead of a dozen torch ops.
    The partials are read ``SB`` splits at a time (``COMBINE_SPLITS_PER_STEP``)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    smask = s < S
    m = tl.load(ml_ptr + (row * S + s) * 2, mask=smask, other=float("-inf"))
    l_sum = tl.load(ml_ptr + (row * S + s) * 2 + 1, mask=smask, other=0.0)
    mx = tl.max(m, 0)
    den = tl.sum(l_sum * tl.where(m == float("-inf"), 0.0, tl.exp(m - mx)), 0)  # empty splits weigh nothing
    d = tl.arange(0, D)
    out = tl.zeros([D], tl.float32)
    for i in range(0, SP // SB):
        sb = i * SB + tl.arange(0, SB)
        bmask = sb < S
        mb = tl.load(ml_ptr + (row * S + sb) * 2, mask=bmask, other=float("-inf"))
        w = tl.where(mb == float("-inf"), 0.0, tl.exp(mb - mx))
        acc = tl.load(acc_ptr + (row * S + sb)[:, None] * D + d[None, :], mask=bmask[:, None], other=0.0)
        out += tl.sum(acc * w[:, None], 0)
    tl.store(out_ptr + row * D + d, f.to_dtype(out / den, out_ptr.dtype.element_ty))  # RNE also in the interpreter


COMBINE_SPLITS_PER_STEP = 256
"""Splits ``combine_kernel`` reads per loop step (SB). H200, batch 1 (32 programs), session 14: all 1024 splits of
a [1024, 128] fp32 tile at once took 62 us per call (spilled registers); 256 at once (the dense attention's 132
splits) cost little (the whole step 0.615 ms at 8K against 0.592 at 1K); steps of 32 added ~15 us per call at 132
splits (sequential loads). So: one step up to 256 splits, steps of 256 beyond (the FP4 fast path is capped at
``kv_attention_plan.MAX_FAST_SPLITS``)."""


def combine_splits(acc: torch.Tensor, ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``combine`` in one Triton launch (``combine_kernel``): [B, Hq, D] in ``dtype``."""
    bsz, hq, splits, d = acc.shape
    out = torch.empty(bsz, hq, d, dtype=dtype, device=acc.device)
    sp = next_pow2(splits)
    combine_kernel[(bsz * hq,)](acc, ml, out, splits, D=d, SP=sp, SB=min(sp, COMBINE_SPLITS_PER_STEP), num_warps=4)
    return out
