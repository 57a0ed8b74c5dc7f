"""Deferred NaN/Inf checks: device-side counters that a whole step reads with one host sync.

A quantize call that checks its input at once (``check_finite=True``) must read a counter back to the
host, which drains the GPU queue: a QAT training step did that ~10 times per layer. A ``FiniteCounter``
instead stays on the device: the Triton quantizers ``atomic_add`` the number of NaN/Inf inputs into it,
and ``raise_if_bad(counters)`` reads every counter of a step in one sync and raises ``NonFiniteError``
naming each offending site. Until then nothing turns into finite garbage: a quantizer given a counter
writes non-finite inputs through to its dequantized output unchanged (NaN stays NaN, Inf stays Inf), so
the loss of that step is non-finite as it would be without FP4.
"""

from __future__ import annotations

import torch

from ..formats.tensor import NonFiniteError


class FiniteCounter:
    """NaN/Inf inputs seen at one named site since the last check (int32 on the site's device). Also counts other
    per-step events read back later (``FP4KVCache.mask_holes``)."""

    def __init__(self, label: str):
        self.label = label
        self._count: torch.Tensor | None = None

    def tensor(self, device) -> torch.Tensor:
        """The counter on ``device`` ([1] int32), allocated at first use; the kernels add into it."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._count is None or self._count.device != device:
            self._count = torch.zeros(1, dtype=torch.int32, device=device)
        return self._count

    def add_bad(self, bad: torch.Tensor) -> None:
        """Add a device count (any integer or bool tensor, summed) without a host sync."""
        self.tensor(bad.device).add_(bad.sum().to(torch.int32))

    @property
    def used(self) -> bool:
        return self._count is not None


def host_values(tensors: list[torch.Tensor]) -> list[int]:
    """The values of 0-d / one-element tensors (ints, bools) as Python ints: one host sync per device."""
    out: list[int | None] = [None] * len(tensors)
    by_dev: dict = {}
    for i, t in enumerate(tensors):
        by_dev.setdefault(t.device, {}).setdefault(t.dtype, []).append(i)
    for by_dtype in by_dev.values():  # one stack per dtype (a few launches, not one per tensor), one read
        idx = [i for ids in by_dtype.values() for i in ids]
        parts = [torch.stack([tensors[i].reshape(()) for i in ids]).long() for ids in by_dtype.values()]
        vals = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        for i, v in zip(idx, vals):
            out[i] = v
    return out


def count_tensors(counters) -> list[torch.Tensor]:
    """The device counts of the used counters (for a caller that reads them with other tensors, one sync)."""
    return [c._count for c in counters if c.used]


def read_and_reset(counters, counts: list[int] | None = None) -> list[tuple[str, int]]:
    """(label, count) of every used counter, read with one host sync (or given: ``counts``, the values of
    ``count_tensors(counters)``), and the counters set to 0."""
    used = [c for c in counters if c.used]
    counts = host_values([c._count for c in used]) if counts is None else counts
    for c in used:
        c._count.zero_()
    return [(c.label, n) for c, n in zip(used, counts)]


def raise_if_bad(counters, *, when: str = "", counts: list[int] | None = None) -> None:
    """Raise ``NonFiniteError`` naming each site whose counter is non-zero (one host sync for all, none when
    the caller read ``counts``: see ``read_and_reset``)."""
    bad = [(label, n) for label, n in read_and_reset(counters, counts) if n]
    if bad:
        sites = "; ".join(f"{label}: {n} NaN/Inf value(s)" for label, n in bad)
        raise NonFiniteError(f"FP4 quantization inputs held NaN/Inf{' ' + when if when else ''} ({sites}); "
                             "FP4 has no NaN/Inf: fix the producer (the values were passed through unquantized)")
