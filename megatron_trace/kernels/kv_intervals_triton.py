"""Triton twin of ``kv_intervals.intervals_reference``: one program per row, one launch per decode step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import cdiv
from .kv_attention_loop import _trip_count

BLOCK = 1024
"""Mask bytes per program per loop step."""


@triton.jit
def mask_intervals_kernel(m_ptr, sm_b, T, n_blocks, first_ptr, end_ptr, holes_ptr, BLOCK: tl.constexpr,
                          HAS_HOLES: tl.constexpr, BLOCKS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lo = tl.full([BLOCK], T, tl.int32)
    hi = tl.zeros([BLOCK], tl.int32)
    n = tl.zeros([BLOCK], tl.int32)
    for i in range(0, _trip_count(n_blocks, BLOCKS)):
        t = i * BLOCK + tl.arange(0, BLOCK)
        a = tl.load(m_ptr + b * sm_b + t, mask=t < T, other=0) != 0
        lo = tl.minimum(lo, tl.where(a, t, T))
        hi = tl.maximum(hi, tl.where(a, t + 1, 0))
        n += a.to(tl.int32)
    first = tl.min(lo, 0)
    end = tl.max(hi, 0)
    tl.store(first_ptr + b, first)
    tl.store(end_ptr + b, end)
    if HAS_HOLES:
        tl.atomic_add(holes_ptr, (tl.sum(n, 0) != tl.maximum(end - first, 0)).to(tl.int32))


def mask_intervals(mask: torch.Tensor, t: int, holes: torch.Tensor | None = None):
    """See ``kv_intervals.mask_intervals`` (arguments checked there)."""
    m = mask if mask.stride(1) == 1 else mask.contiguous()
    m = m.view(torch.uint8) if m.dtype == torch.bool else m
    b = m.shape[0]
    first = torch.empty(b, dtype=torch.int32, device=m.device)
    end = torch.empty_like(first)
    n_blocks = cdiv(t, BLOCK)
    mask_intervals_kernel[(b,)](m, m.stride(0), t, n_blocks, first, end, first if holes is None else holes,
                                BLOCK=BLOCK, HAS_HOLES=holes is not None, BLOCKS=0 if m.is_cuda else n_blocks)
    return first, end
