"""A decode step's attention mask as one interval of attended positions per row: (first, end).

The rollout's masks attend one run of positions per row: left padding before it, and after it the positions a
finished row was fed while the others went on (``HFRolloutBackend.generate``). Given as ``starts`` / ``lengths``,
the FP4-KV decode attention (``kv_attention``) neither loads the mask nor reads the rows outside the interval.

``mask_intervals(mask, t)``: bool/uint8 [B, >= T] (True / non-zero attends; a row stride, unit column stride) ->
(first int32 [B], end int32 [B]) over the first T columns, and the number of rows whose attended positions are
not exactly [first, end) (a hole) added into ``holes`` (int32 [1]) when given: a row with a hole would be attended
over its whole interval, so the caller must check the count. A row attending nothing gets (T, 0). One Triton
launch on CUDA (``kv_intervals_triton``), torch ops elsewhere: the same values.
"""

from __future__ import annotations

import torch

from .dispatch import Kernel, select_kernel


def _check(mask: torch.Tensor, t: int) -> None:
    if mask.dim() != 2 or mask.shape[1] < t or mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"mask must be bool or uint8 [B, >= T={t}], got {mask.dtype} {tuple(mask.shape)}")


def intervals_reference(mask: torch.Tensor, t: int, holes: torch.Tensor | None = None):
    """Torch twin of the kernel (see the module docstring)."""
    _check(mask, t)
    m = mask[:, :t] != 0
    idx = torch.arange(t, device=m.device, dtype=torch.int32)
    first = torch.where(m, idx, t).amin(-1) if t else torch.zeros(m.shape[0], dtype=torch.int32, device=m.device)
    end = torch.where(m, idx + 1, 0).amax(-1) if t else torch.zeros_like(first)
    if holes is not None:
        holes.add_((m.sum(-1) != (end - first).clamp(min=0)).sum().to(torch.int32))
    return first.to(torch.int32), end.to(torch.int32)


def mask_intervals(mask: torch.Tensor, t: int, holes: torch.Tensor | None = None, *,
                   kernel: str | Kernel = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(first, end) int32 [B] of each row's attended positions among the first ``t`` (see the module docstring)."""
    if select_kernel(kernel, mask.device) is Kernel.REFERENCE or t == 0:
        return intervals_reference(mask, t, holes)
    _check(mask, t)
    from . import kv_intervals_triton

    return kv_intervals_triton.mask_intervals(mask, t, holes)
