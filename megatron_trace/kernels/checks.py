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


class ReadyPoint:
    """The point of a CUDA stream after which some device values are final: ``mark()`` after queueing each of
    their producers. ``host_values(..., ready=points)`` then reads the values on a side stream that waits for these
    points only, not for the whole current stream: a check at the end of a step's backward (``check_finite``)
    does not drain the GPU, so the host's next launches (the optimizer) overlap the backward's last kernels
    instead of starting on an idle GPU. ``forget()``: a producer that will not mark was queued (readers sync)."""

    def __init__(self):
        self.event: torch.cuda.Event | None = None
        self.device: torch.device | None = None
        self.known = True  # False after forget() until the next mark()

    def mark(self, device) -> None:
        self.known = True
        device = _indexed(device)
        if device.type != "cuda":  # (host values: nothing to wait for)
            return
        if self.event is None or self.device != device:
            self.event, self.device = torch.cuda.Event(), device
        self.event.record(torch.cuda.current_stream(device))

    def forget(self) -> None:
        self.known = False


def _indexed(device) -> torch.device:
    """``device`` as a torch.device, "cuda" with the current GPU's index (tensors name theirs: cuda:0 != cuda)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class FiniteCounter:
    """NaN/Inf inputs seen at one named site since the last check (int64 on the site's device: an all-NaN tensor of
    2**31 elements or more would wrap an int32 count, to 0 at 2**32). Also counts other per-step events read back
    later (``FP4KVCache.mask_holes``). ``ready``: where its adds so far end, when every producer marked it
    (``mark``); ``tensor()`` forgets it until then.

    ``marks=False``: ``mark()`` records nothing, so a read waits for the current stream. For producers that may run
    inside a CUDA graph capture (the rollout's decode step): an event recorded there cannot be waited on after the
    capture (``cudaErrorCapturedEvent``); it also saves the event record's host time per call."""

    def __init__(self, label: str, *, marks: bool = True):
        self.label = label
        self.marks = marks
        self._count: torch.Tensor | None = None
        self.ready = ReadyPoint()

    def tensor(self, device) -> torch.Tensor:
        """The counter on ``device`` ([1] int64), allocated at first use; the kernels add into it (and the caller
        calls ``mark()`` once they are queued, else a read waits for the whole stream)."""
        device = _indexed(device)
        if self._count is None or self._count.device != device:
            self._count = torch.zeros(1, dtype=torch.int64, device=device)
        self.ready.forget()
        return self._count

    def mark(self) -> None:
        """The producers that took ``tensor()`` so far are queued on the current stream."""
        if self._count is not None and self.marks:
            self.ready.mark(self._count.device)

    def add_bad(self, bad: torch.Tensor) -> None:
        """Add a device count (any integer or bool tensor, summed) without a host sync."""
        self.tensor(bad.device).add_(bad.sum().to(torch.int64))
        self.mark()

    @property
    def used(self) -> bool:
        return self._count is not None


def host_values(tensors: list[torch.Tensor], ready: list[ReadyPoint] | None = None) -> list[int]:
    """The values of 0-d / one-element tensors (ints, bools) as Python ints: one host sync per device.

    ``ready``: points after which every tensor is final (their producers marked them); a GPU's values are then
    read on a side stream that waits for those points only, not for the current stream's later work. Without
    it, or where a point is not known, the read waits for the current stream."""
    out: list[int | None] = [None] * len(tensors)
    by_dev: dict = {}
    for i, t in enumerate(tensors):
        by_dev.setdefault(t.device, {}).setdefault(t.dtype, []).append(i)
    for dev, by_dtype in by_dev.items():  # one stack per dtype (a few launches, not one per tensor), one read
        idx = [i for ids in by_dtype.values() for i in ids]
        points = _points_on(dev, ready)
        if points is None:
            vals = _stacked(tensors, by_dtype).tolist()
        else:
            vals = _read_after(tensors, by_dtype, dev, points)
        for i, v in zip(idx, vals):
            out[i] = v
    return out


def _stacked(tensors, by_dtype: dict) -> torch.Tensor:
    parts = [torch.stack([tensors[i].reshape(()) for i in ids]).long() for ids in by_dtype.values()]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _points_on(dev: torch.device, ready) -> list[ReadyPoint] | None:
    """The marked points of ``ready`` on GPU ``dev``, or None: not a GPU, no points, or one not known."""
    if ready is None or dev.type != "cuda" or not all(p.known for p in ready):
        return None
    points = [p for p in ready if p.event is not None and p.device == dev]
    return points or None


_SIDE: dict = {}  # device -> (side stream, pinned int64 host buffer)


def _read_after(tensors, by_dtype: dict, dev: torch.device, points: list[ReadyPoint]) -> list[int]:
    """``_stacked`` values read on a side stream of ``dev`` after ``points``, into a pinned buffer kept per device
    (allocating pinned memory waits for the device: only the first read of a device, or a larger one, does)."""
    n = sum(len(ids) for ids in by_dtype.values())
    side, host = _SIDE.get(dev, (None, None))
    if side is None:
        side = torch.cuda.Stream(dev)
    if host is None or host.numel() < n:
        host = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=True)
    _SIDE[dev] = (side, host)
    for p in points:
        side.wait_event(p.event)
    with torch.cuda.stream(side):
        host[:n].copy_(_stacked(tensors, by_dtype), non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    return host[:n].tolist()


def count_tensors(counters) -> list[torch.Tensor]:
    """The device counts of the used counters (for a caller that reads them with other tensors, one sync)."""
    return [c._count for c in counters if c.used]


def count_ready(counters) -> list[ReadyPoint]:
    """The ready points of the used counters (``host_values``' ``ready`` for ``count_tensors(counters)``)."""
    return [c.ready for c in counters if c.used]


def read_and_reset(counters, counts: list[int] | None = None) -> list[tuple[str, int]]:
    """(label, count) of every used counter, read with one host sync (after their producers only, where all
    marked: ``FiniteCounter.ready``) or given (``counts``, the values of ``count_tensors(counters)``), and the
    counters set to 0."""
    used = [c for c in counters if c.used]
    counts = host_values([c._count for c in used], ready=count_ready(used)) if counts is None else counts
    for c in used:
        c._count.zero_()
        c.mark()  # (the zeroing is the counter's latest write: a later read waits for it)
    return [(c.label, n) for c, n in zip(used, counts)]


def raise_if_bad(counters, *, when: str = "", counts: list[int] | None = None) -> None:
    """Raise ``NonFiniteError`` naming each site whose counter is non-zero (one host sync for all, none when
    the caller read ``counts``: see ``read_and_reset``)."""
    bad = [(label, n) for label, n in read_and_reset(counters, counts) if n]
    if bad:
        raise NonFiniteError(f"FP4 quantization inputs held NaN/Inf{' ' + when if when else ''} ({named(bad)}); "
                             "FP4 has no NaN/Inf: fix the producer (the values were passed through unquantized)")


def named(bad: list[tuple[str, int]]) -> str:
    """The sites and counts of ``read_and_reset``'s non-zero rows, for a message."""
    return "; ".join(f"{label}: {n} NaN/Inf value(s)" for label, n in bad)
