"""Weight sync from the trainer to a rollout backend: BF16 or packed FP4 routed experts.

Both paths take a stream of (HF checkpoint name, tensor) — e.g. ``export_hf_weights`` of the
Megatron model — and call ``backend.update_weights`` (in-place copies on the rollout side).

  bf16  every tensor is sent in ``dtype`` (default bfloat16); a rollout in FP4 mode quantizes
        the routed experts itself.
  fp4   routed-expert weights are quantized here with ``TraceConfig.weight_quantizer()``, from
        the trainer's own values (so the codes are the trainer's fake-quant codes bit for bit),
        and sent as packed codes + block scales + global amax; everything else as in bf16.
        fc1 = [gate; up] is quantized as one matrix (Megatron's ``linear_fc1``) and sent as its
        gate and up row halves sharing the amax.

``sync_byte_counts`` gives the bytes each path moves without syncing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..formats import FP4Tensor, Quantizer
from ..rollout.base import RolloutBackend, WeightValue
from ..rollout.experts import fp4_nbytes
from ..rollout.hf_weights import expert_name, parse_expert_name, split_fc1

logger = logging.getLogger(__name__)

SYNC_FORMATS = ("bf16", "fp4")


def value_nbytes(value: WeightValue) -> int:
    """Bytes a tensor or FP4 tensor occupies on the wire."""
    if isinstance(value, FP4Tensor):
        return fp4_nbytes(value)
    return value.numel() * value.element_size()


@dataclass
class SyncStats:
    """Bytes and tensors of one sync."""

    fmt: str
    tensors: int = 0
    bytes_experts: int = 0
    bytes_other: int = 0

    @property
    def bytes_total(self) -> int:
        return self.bytes_experts + self.bytes_other

    def add(self, name: str, value: WeightValue) -> None:
        self.tensors += 1
        if parse_expert_name(name) is not None:
            self.bytes_experts += value_nbytes(value)
        else:
            self.bytes_other += value_nbytes(value)

    def as_dict(self, prefix: str = "sync") -> dict[str, float]:
        p = f"{prefix}/{self.fmt}"
        return {f"{p}/bytes_total": float(self.bytes_total), f"{p}/bytes_experts": float(self.bytes_experts),
                f"{p}/bytes_other": float(self.bytes_other), f"{p}/tensors": float(self.tensors)}


def _cast(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return value.detach().to(dtype) if value.is_floating_point() else value.detach()


def bf16_stream(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor cast to ``dtype``."""
    for name, value in named:
        yield name, _cast(value, dtype)


def fp4_stream(named: Iterable[tuple[str, torch.Tensor]], quantizer: Quantizer,
               dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, WeightValue]]:
    """Routed-expert weights as FP4 (quantized from the values as given), the rest cast to ``dtype``."""
    pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name, value in named:
        parsed = parse_expert_name(name)
        if parsed is None:
            yield name, _cast(value, dtype)
            continue
        layer, e, proj = parsed
        if proj == "down_proj":
            yield name, quantizer.quantize(value.detach())
            continue
        halves = pending.setdefault((layer, e), {})
        halves[proj] = value.detach()
        if len(halves) == 2:
            del pending[(layer, e)]
            gate, up = split_fc1(quantizer.quantize(torch.cat([halves["gate_proj"], halves["up_proj"]])))
            yield expert_name(layer, e, "gate_proj"), gate
            yield expert_name(layer, e, "up_proj"), up
    if pending:
        raise ValueError(f"expert fc1 halves without their partner (gate_proj and up_proj must both be sent): "
                         f"{sorted(pending)[:5]}")


def make_stream(named, fmt: str, quantizer: Quantizer | None = None, dtype: torch.dtype = torch.bfloat16):
    if fmt not in SYNC_FORMATS:
        raise ValueError(f"fmt={fmt!r} is not one of {SYNC_FORMATS}")
    if fmt == "fp4":
        if quantizer is None:
            raise ValueError("fmt='fp4' needs the weight quantizer (TraceConfig.weight_quantizer())")
        return fp4_stream(named, quantizer, dtype)
    return bf16_stream(named, dtype)


def sync_weights(backend: RolloutBackend, named: Iterable[tuple[str, torch.Tensor]], *, fmt: str = "bf16",
                 quantizer: Quantizer | None = None, dtype: torch.dtype = torch.bfloat16,
                 version: int | None = None) -> SyncStats:
    """Send ``named`` weights to ``backend`` (BF16 or FP4 experts); returns what was moved."""
    stats = SyncStats(fmt)
    payload = []
    for name, value in make_stream(named, fmt, quantizer, dtype):
        stats.add(name, value)
        payload.append((name, value))
    backend.update_weights(payload, version=version)
    logger.info("weight sync (%s): %d tensors, %.2f MB (experts %.2f MB)", fmt, stats.tensors,
                stats.bytes_total / 1e6, stats.bytes_experts / 1e6)
    return stats


def sync_byte_counts(named: Iterable[tuple[str, torch.Tensor]], quantizer: Quantizer,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, SyncStats]:
    """Bytes per sync of both paths for the same weights: ``{"bf16": SyncStats, "fp4": SyncStats}``."""
    named = list(named)
    out = {}
    for fmt in SYNC_FORMATS:
        stats = SyncStats(fmt)
        for name, value in make_stream(named, fmt, quantizer, dtype):
            stats.add(name, value)
        out[fmt] = stats
    return out
