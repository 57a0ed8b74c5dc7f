"""Per-step state shared by the TRACE modules of one model while a ``trace_guidance`` context is open.

``StepState`` holds what every layer needs (config, counter, fallback policy, recording);
``SiteCheck`` validates a ``SiteGuidance`` once against the layer's dimensions. Counting
reasons (rows that fell back to the trainer's own rounding):

  not_guided_layer  the layer is outside the layer policy
  missing           no guidance for this (layer, site)
  shape             the guidance does not fit the layer or the batch (rejected as a whole)
  format            the record's format is not the site's (``TraceConfig.kv_record_format`` at KV sites,
                    ``format`` elsewhere), e.g. SGLang's KV records for a trainer without ``kv_format``
  invalid_row       the record marks the row invalid (not recorded, rejected at assembly)
  expert_mismatch   FC2: the trainer routed the token to an expert the rollout did not choose

Rows are counted once per forward: the recompute pass of Megatron's activation recomputation
(``recompute_granularity`` full or selective, run inside the backward) reuses the step's
guidance and routing but is not counted again (``in_recompute``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from ..config import TraceConfig
from ..formats import CompactGuidance, FullGuidance, e2m1
from ..guidance.site import FallbackCounter, SiteGuidance
from ..kernels.checks import host_values
from ..manifest import KV_SITES
from .rows import Record, RowGuidance, map_record, token_major

logger = logging.getLogger(__name__)

NOT_GUIDED = "not_guided_layer"
MISSING = "missing"
SHAPE = "shape"
FORMAT = "format"
INVALID = "invalid_row"
EXPERT_MISMATCH = "expert_mismatch"


def in_recompute() -> bool:
    """True inside the recompute pass of Megatron's activation checkpointing.

    ``tensor_parallel.checkpoint`` runs the checkpointed forward under ``no_grad`` and re-runs it
    with grad enabled from the backward, both with Megatron's checkpointing flag set.
    """
    return is_checkpointing() and torch.is_grad_enabled()


class GuidanceFallbackError(ValueError):
    """Rows at a guided site had no usable guidance while ``fallback='fail'``."""


class GuidanceCoverageError(ValueError):
    """The step's coverage at guided sites fell below ``min_coverage``."""


@dataclass
class StepState:
    """Everything the modules share during one step."""

    config: TraceConfig
    counter: FallbackCounter
    fallback: str
    guided_layers: frozenset[int]
    token_mask: torch.Tensor | None = None  # bool [B, S]: positions that hold tokens (others not counted)
    recorder: object | None = None  # Recorder when recording
    stats: Counter = field(default_factory=Counter)  # (layer, site, reason) -> rows; reason "used" too
    pending: list = field(default_factory=list)  # counts not yet resolved (see ``count``)
    deferred: list = field(default_factory=list)  # (bool device tensor: bad, message) checked by ``resolve``

    def is_guided(self, layer: int, site: str) -> bool:
        c = self.config
        return layer in self.guided_layers and site in c.guided_sites and c.quantizes(site)

    @property
    def compact(self) -> bool:
        return self.config.cache_mode == "compact"

    def count(self, layer: int, site: str, used, reasons: dict) -> None:
        """Count rows (ints or 0-d device tensors); tensors are resolved at once by ``resolve``.

        Deferred counting keeps the forward free of host syncs; with ``fallback='fail'`` a site that
        may hold unusable rows is resolved here, so the error is raised where it happens.
        """
        if in_recompute():
            return  # the same rows were counted (and checked) by the forward
        self.pending.append((layer, site, used, reasons))
        if self.fallback == "fail" and any(k != NOT_GUIDED for k in reasons):
            self.resolve()

    def defer_check(self, bad: torch.Tensor, message: str) -> None:
        """Raise ``RuntimeError(message)`` at the next ``resolve`` if ``bad`` (a device bool) is True."""
        self.deferred.append((bad, message))

    def resolve(self) -> None:
        """Apply the pending counts and deferred checks with one host sync for all their tensors."""
        pending, deferred = list(self.pending), list(self.deferred)
        self.pending.clear()  # in place: layer views of this state (``dataclasses.replace``) share the list
        self.deferred.clear()
        tensors = [v for _, _, u, r in pending for v in (u, *r.values()) if isinstance(v, torch.Tensor)]
        values = host_values(tensors + [b for b, _ in deferred])
        failed = [msg for (_, msg), bad in zip(deferred, values[len(tensors):]) if bad]
        host = iter(values[: len(tensors)])
        val = lambda v: next(host) if isinstance(v, torch.Tensor) else int(v)  # noqa: E731
        for layer, site, used, reasons in pending:
            used = val(used)
            reasons = {k: n for k, n in ((k, val(v)) for k, v in reasons.items()) if n}
            self._apply(layer, site, used, reasons)
        if failed:
            raise RuntimeError("; ".join(failed))

    def _apply(self, layer: int, site: str, used: int, reasons: dict[str, int]) -> None:
        self.counter.add(used, reasons)
        self.stats[(layer, site, "used")] += used
        for k, v in reasons.items():
            self.stats[(layer, site, k)] += v
        bad = {k: v for k, v in reasons.items() if k != NOT_GUIDED}
        if bad and self.fallback == "fail":
            raise GuidanceFallbackError(
                f"layer {layer} site {site!r}: rows without usable guidance {bad} and fallback='fail' "
                "(use fallback='rne' to fall back to the trainer's own rounding)"
            )

    def count_mask(self, seq: slice, tokens: int, device) -> torch.Tensor:
        """bool [T]: which local tokens count (Megatron token order)."""
        if self.token_mask is None:
            return torch.ones(tokens, dtype=torch.bool, device=device)
        m = token_major(self.token_mask.to(device), seq)
        if m.numel() != tokens:
            raise ValueError(f"StepGuidance.token_mask {tuple(self.token_mask.shape)} does not fit {tokens} tokens")
        return m

    def coverage_at_guided(self) -> float:
        self.resolve()
        used = self.counter.used
        fell = sum(v for k, v in self.counter.fallback.items() if k != NOT_GUIDED)
        return used / (used + fell) if used + fell else 1.0


def as_mode(record: Record, compact: bool) -> Record | None:
    """The record in the cache mode of the config: full -> compact is derived, compact -> full is impossible."""
    if isinstance(record, CompactGuidance) == compact:
        return record
    if isinstance(record, CompactGuidance):
        return None
    bits = e2m1.pack_bits(e2m1.mantissa_bit(e2m1.unpack(record.codes)))
    return CompactGuidance(
        mantissa_bits=bits, block_scales=record.block_scales, global_amax=record.global_amax,
        shape=record.shape, fmt=record.fmt,
    )


@dataclass(frozen=True)
class CheckedSite:
    """A site's guidance accepted for a layer (``sg`` is None when rejected or missing: ``reason``)."""

    sg: SiteGuidance | None
    reason: str | None
    all_valid: bool = False  # every row of sg is valid (found once per step, on the host)


def check_site(sg: SiteGuidance | None, *, site: str, layer: int, rows: tuple[int, ...], config: TraceConfig,
               compact: bool, fail: bool) -> CheckedSite:
    """Accept ``sg`` if its format (``TraceConfig.kv_record_format`` at KV sites, ``format`` elsewhere) and
    per-row dims are ``rows`` (dims after [B, S])."""
    if sg is None:
        return CheckedSite(None, MISSING)
    r = sg.record
    kv = site in KV_SITES
    want = config.kv_record_format if kv else config.format
    if r.fmt != want:  # e.g. SGLang's fp4_e2m1 KV records ("sglang_kvfp4") for a trainer without kv_format
        name = "kv_format" if kv and config.kv_format else "format"
        msg = f"guidance for layer {layer} site {site!r} rejected: format {r.fmt!r} != TraceConfig.{name} {want!r}"
        if fail:
            raise GuidanceFallbackError(msg)
        logger.warning(msg)
        return CheckedSite(None, FORMAT)
    problem = None
    if tuple(r.shape[2:]) != tuple(rows):
        problem = f"row dims {tuple(r.shape[2:])} != the layer's {tuple(rows)}"
    elif r.fmt == "nvfp4" and (r.global_amax is None or (r.global_amax.dim() and r.global_amax.shape[-1] != 1)):
        problem = "NVFP4 guidance needs a per-row (or per-tensor) global_amax"
    elif r.fmt != "nvfp4" and r.global_amax is not None:
        problem = f"{r.fmt} guidance must not carry a global_amax"
    elif site == "expert_fc2_in" and sg.expert_ids is None:
        problem = "expert_fc2_in guidance needs expert_ids"
    mode = as_mode(r, compact) if problem is None else None
    if problem is None and mode is None:
        problem = "compact guidance cannot serve cache_mode='full'"
    if problem is not None:
        msg = f"guidance for layer {layer} site {site!r} rejected: {problem}"
        if fail:
            raise GuidanceFallbackError(msg)
        logger.warning(msg)
        return CheckedSite(None, SHAPE)
    return CheckedSite(SiteGuidance(mode, sg.valid, sg.expert_ids), None)


def token_rows(sg: SiteGuidance, seq: slice, device) -> tuple[Record, torch.Tensor, torch.Tensor | None]:
    """Batch-major guidance -> (record [T, *rows], valid [T, ...], expert_ids [T, ...]) in token order,
    on ``device`` (the model's)."""
    r = sg.record
    tm = lambda t: token_major(t.to(device), seq)  # noqa: E731
    valid = tm(sg.valid)
    rec = map_record(r, tm, (valid.shape[0], *r.shape[2:]))
    ids = None if sg.expert_ids is None else tm(sg.expert_ids)
    return rec, valid, ids


def flat_rows(record: Record, valid: torch.Tensor) -> RowGuidance:
    """[T, ..., K] record -> RowGuidance over all leading dims flattened."""
    k = record.shape[-1]
    n = valid.numel()
    rec = map_record(record, lambda t: t.reshape(n, *t.shape[valid.dim():]), (n, k))
    return RowGuidance(rec, valid.reshape(n))


def local_seq(hidden_seq: int, full_seq: int, tp_rank: int, sequence_parallel: bool) -> slice:
    """The positions of the full sequence this rank holds (sequence parallel shards S evenly)."""
    if sequence_parallel and hidden_seq != full_seq:
        return slice(tp_rank * hidden_seq, (tp_rank + 1) * hidden_seq)
    return slice(0, hidden_seq)


def full_from_fp4(q) -> FullGuidance:
    return q.guidance(compact=False)
