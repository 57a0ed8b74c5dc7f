"""The recorder's store for fixed-buffer decode steps (``rollout.static_decode``): every step's records and routing
go into buffers allocated once, at a step index held on the device, so a CUDA graph that captured one step's
writes replays them for every step.

Values are batch-major ``[B, n, ...]`` per step (a guidance record's tensors, or the routing indices); step ``i``
fills rows ``i * n .. i * n + n - 1`` of a buffer ``[B, steps * n, ...]``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import CompactGuidance, FullGuidance
from .base import check_count

Record = FullGuidance | CompactGuidance
Value = Record | torch.Tensor
_PAYLOAD = {FullGuidance: "codes", CompactGuidance: "mantissa_bits"}
_FP8 = (torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _tensors(v: Value) -> list[torch.Tensor]:
    """The tensors of a value (float8 scales as their bytes: index_copy_ has no float8 kernels on the CPU)."""
    if isinstance(v, torch.Tensor):
        return [v]
    scales = v.block_scales.view(torch.uint8) if v.block_scales.dtype in _FP8 else v.block_scales
    return [getattr(v, _PAYLOAD[type(v)]), scales] + ([] if v.global_amax is None else [v.global_amax])


def _map(v: Value, fn, rows: int) -> Value:
    """``fn`` on every tensor of v (their first two dims: batch, rows), the result with ``rows`` rows (and the batch
    rows ``fn`` gives: ``select`` forks them)."""
    if isinstance(v, torch.Tensor):
        return fn(v)
    payload = _PAYLOAD[type(v)]
    scales = v.block_scales
    scales = fn(scales.view(torch.uint8)).view(scales.dtype) if scales.dtype in _FP8 else fn(scales)
    amax = None if v.global_amax is None else fn(v.global_amax)
    data = fn(getattr(v, payload))
    return dataclasses.replace(v, block_scales=scales, global_amax=amax, shape=(data.shape[0], rows, *v.shape[2:]),
                               **{payload: data})


class StaticSteps:
    """Buffers of ``steps`` decode steps per key, written at step ``index`` (int64 [1] on ``device``, set by the
    caller before each step); ``count`` (host) is how many steps hold values."""

    def __init__(self, steps: int, device: torch.device):
        self.steps = check_count("steps", steps)  # (2.5 was taken)
        self.index = torch.zeros(1, dtype=torch.long, device=device)
        self.count = 0
        self._bufs: dict[object, tuple[Value, int]] = {}
        self._rows: dict[int, torch.Tensor] = {}

    def keys(self) -> list:
        return list(self._bufs)

    def put(self, key, value: Value) -> None:
        """Write one step's ``value`` [B, n, ...] at step ``index`` (the first call allocates the buffer)."""
        n = value.shape[1]
        if key not in self._bufs:
            alloc = lambda t: t.new_zeros((t.shape[0], self.steps * n, *t.shape[2:]))  # noqa: E731
            self._bufs[key] = (_map(value, alloc, self.steps * n), n)
        buf, n0 = self._bufs[key]
        if n != n0 or value.shape[0] != buf.shape[0]:
            raise ValueError(f"{key}: a step of [{value.shape[0]}, {n}, ...] rows, the buffer holds "
                             f"[{buf.shape[0]}, {n0} per step, ...]")
        if n not in self._rows:
            self._rows[n] = torch.arange(n, device=self.index.device)
        rows = self.index * n + self._rows[n]
        for dst, src in zip(_tensors(buf), _tensors(value), strict=True):
            dst.index_copy_(1, rows, src)

    def chunks(self, key) -> list[Value]:
        """[``view(key)``], or [] for a key no step wrote."""
        return [self.view(key)] if key in self._bufs else []

    def view(self, key) -> Value:
        """Key's values of the ``count`` steps so far: [B, count * n, ...] (views of the buffer)."""
        buf, n = self._bufs[key]
        return _map(buf, lambda t: t[:, : self.count * n], self.count * n)

    def select(self, index: torch.Tensor) -> None:
        """Keep (or fork) batch rows ``index`` of every buffer."""
        self._bufs = {k: (_map(b, lambda t: t.index_select(0, index.to(t.device)), b.shape[1]), n)
                      for k, (b, n) in self._bufs.items()}
