"""The contract between rollout, guidance cache and trainer: guidance for one (layer, site).

Everything speaks ``SiteGuidance`` laid out batch-major over the sequences of a batch
(``B`` sequences, ``S`` positions each, prompt + response, padded):

  site            record.shape            valid      expert_ids
  expert_fc1_in   [B, S, hidden]          [B, S]     -
  expert_fc2_in   [B, S, topk, ffn]       [B, S, k]  [B, S, topk] (int64; the rollout's choices)
  kv_k, kv_v      [B, S, kv_heads, hd]    [B, S]     -

``record`` is a ``FullGuidance`` or ``CompactGuidance`` of that shape (NVFP4 ``global_amax``
is per row: [..., 1]). Rows where ``valid`` is False carry zeros and are not used: the
trainer falls back to its own rounding there and counts the reason. Consumers (the Megatron
plugin) map these rows onto their own layout (e.g. Megatron's [S, B] token order).
"""

from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..formats import CompactGuidance, FullGuidance, get_format

NOT_GUIDED = "not_guided_layer"
"""The fallback reason of rows at layers outside the layer policy (not guided sites: not in the coverage)."""

SiteKey = tuple[int, str]
"""(layer id from 0, site name): guidance is keyed by module identity, never by list position."""


def check_rows(record, valid: torch.Tensor, expert_ids: torch.Tensor | None, lead_dims: int) -> None:
    """A record's side tensors fit its rows: ``valid`` bool and ``expert_ids`` integer over the leading
    ``lead_dims`` dims (all but the last with expert ids), ``global_amax`` one value or one per row; the payload
    is packed uint8 and the block scales are of the format's scale dtype."""
    payload = record.mantissa_bits if isinstance(record, CompactGuidance) else record.codes
    if payload.dtype != torch.uint8:
        name = "mantissa_bits" if isinstance(record, CompactGuidance) else "codes"
        raise ValueError(f"{type(record).__name__}.{name} is {payload.dtype}: guidance payloads are packed torch.uint8")
    scale_dtype = get_format(record.fmt).scale_dtype
    if record.block_scales.dtype != scale_dtype:
        raise ValueError(f"{record.fmt} block_scales are {record.block_scales.dtype}, the format's are {scale_dtype}")
    lead = tuple(record.shape[:-1]) if expert_ids is not None else tuple(record.shape[:lead_dims])
    if expert_ids is not None and (tuple(expert_ids.shape) != lead or expert_ids.is_floating_point()
                                   or expert_ids.dtype == torch.bool):
        raise ValueError(f"expert_ids must be integer of shape {lead} (the record's rows), got {expert_ids.dtype} "
                         f"{tuple(expert_ids.shape)}")
    if valid.dtype != torch.bool or tuple(valid.shape) != lead:
        raise ValueError(f"valid must be bool of shape {lead}, got {valid.dtype} {tuple(valid.shape)}")
    g = record.global_amax
    if g is not None and g.dim() and tuple(g.shape) != (*record.shape[:-1], 1):
        raise ValueError(f"global_amax shape {tuple(g.shape)} must be [] (one amax) or {(*record.shape[:-1], 1)} "
                         "(one per row)")


def is_integer(v) -> bool:
    """An integer: Python or NumPy (not bool), or a 0-d tensor of an integer dtype."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool)
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _count(v) -> bool:
    """An int >= 0 (``is_integer``; a 0-d tensor: one host read, as ``int()`` does)."""
    return is_integer(v) and v >= 0


@dataclass(frozen=True)
class SiteGuidance:
    record: FullGuidance | CompactGuidance
    valid: torch.Tensor
    expert_ids: torch.Tensor | None = None
    # rows of a NaN / Inf / negative / impossible scale or amax made invalid (``records.reject_bad_scales``: every
    # assembly from the cache or a sync does it): the trainer's step does not look again
    scales_checked: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self):
        check_rows(self.record, self.valid, self.expert_ids, 2)

    @property
    def compact(self) -> bool:
        return isinstance(self.record, CompactGuidance)


@dataclass
class FallbackCounter:
    """Counts guided rows used and rows that fell back, by reason (logged every step)."""

    used: int = 0
    fallback: Counter = field(default_factory=Counter)

    def add(self, used: int, reason_counts: dict[str, int] | None = None) -> None:
        counts = {"used": used, **(reason_counts or {})}
        bad = {k: v for k, v in counts.items() if not _count(v)}
        if bad:  # (-3 rows made a coverage of -0.5, 2.5 was truncated, "3" parsed)
            raise ValueError(f"FallbackCounter.add needs row counts that are ints >= 0, got {bad}")
        self.used += int(used)
        for k, v in (reason_counts or {}).items():
            if v:
                self.fallback[k] += int(v)

    @property
    def coverage(self) -> float:
        """Rows used / rows at guided sites (rows of layers outside the layer policy, ``NOT_GUIDED``, left out)."""
        fell = sum(v for k, v in self.fallback.items() if k != NOT_GUIDED)
        return self.used / (self.used + fell) if self.used + fell else 1.0

    def as_dict(self, prefix: str = "guidance") -> dict[str, float]:
        d = {f"{prefix}/coverage": self.coverage, f"{prefix}/rows_used": float(self.used)}
        # reasons under ``{prefix}/fallback/``, the keys ``metrics.guidance_step_metrics`` gives them
        d.update({f"{prefix}/fallback/{k}": float(v) for k, v in sorted(self.fallback.items())})
        return d
