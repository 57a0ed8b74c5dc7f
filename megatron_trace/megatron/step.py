"""Per-step state shared by the TRACE modules of one model while a ``trace_guidance`` context is open.

``StepState`` holds what every layer needs (config, counter, fallback policy, recording);
``check_site`` validates a ``SiteGuidance`` once against the layer's dimensions (a ``CheckedSite``). Counting
reasons (rows that fell back to the trainer's own rounding):

  not_guided_layer  the layer is outside the layer policy
  missing           no guidance for this (layer, site)
  shape             the guidance does not fit the layer or the batch (rejected as a whole)
  format            the record's format is not the site's (``TraceConfig.kv_record_format`` at KV sites,
                    ``format`` elsewhere), e.g. SGLang's KV records for a trainer without ``kv_format``
  invalid_row       the record marks the row invalid (not recorded, rejected at assembly), or the row's scale
                    is one no quantizer writes (``scales_ok``: records given to the step directly; the
                    assembly counts those ``bad_scale``)
  expert_mismatch   FC2: the trainer routed the token to an expert the rollout did not choose

Rows are counted once per forward: the recompute pass of Megatron's activation recomputation
(``recompute_granularity`` full or selective, run inside the backward) reuses the step's
guidance and routing but is not counted again (``in_recompute``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from megatron.core.tensor_parallel.random import _unset_checkpointing, is_checkpointing

from ..config import TraceConfig
from ..formats import CompactGuidance, FullGuidance, e2m1
from ..guidance.records import scales_ok
from ..guidance.site import NOT_GUIDED, FallbackCounter, SiteGuidance
from ..kernels.checks import ReadyPoint, host_values
from ..manifest import KV_SITES
from .gemm import to_device_async
from .rows import Record, RowGuidance, map_record, token_major

logger = logging.getLogger(__name__)

MISSING = "missing"
SHAPE = "shape"
FORMAT = "format"
INVALID = "invalid_row"
EXPERT_MISMATCH = "expert_mismatch"


def in_recompute(checkpointed: bool = False) -> bool:
    """True inside the recompute pass of Megatron's activation checkpointing.

    ``tensor_parallel.checkpoint`` runs the checkpointed forward under ``no_grad`` and re-runs it
    with grad enabled from the backward, both with Megatron's checkpointing flag set. ``checkpointed``: the
    caller always runs inside a checkpoint of its own (a MoE layer with ``recompute_modules`` "moe"), whose
    flag a checkpoint nested in it may have cleared as it ended (the shared experts', with "shared_experts"
    too): its passes with gradients are then its recompute passes, the flag aside.
    """
    return torch.is_grad_enabled() and (checkpointed or is_checkpointing())


def in_checkpoint_first_pass(checkpointed: bool = False) -> bool:
    """True inside an activation checkpoint's first (gradient-free) pass; ``checkpointed`` as in ``in_recompute``.
    A forward-only run through checkpoints passes for one too (its recompute never comes)."""
    return not torch.is_grad_enabled() and (checkpointed or is_checkpointing())


def clear_checkpointing_flag() -> None:
    """Clear Megatron's checkpointing flag where an error inside a checkpoint's pass left it set: the next step's
    forwards would otherwise pass for recompute passes."""
    if is_checkpointing():
        _unset_checkpointing()


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
    index_cache: dict = field(default_factory=dict)  # row orders of this step's layouts (``token_index``)
    ready: ReadyPoint = field(default_factory=ReadyPoint)  # where the pending / deferred tensors are final
    checkpointed: bool = False  # this layer's view: it runs inside its own activation checkpoint (``in_recompute``)
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
        if in_recompute(self.checkpointed):
            return  # the same rows were counted (and checked) by the forward
        self.pending.append((layer, site, used, reasons))
        self._mark(used, *reasons.values())
        if self.fallback == "fail" and any(k != NOT_GUIDED for k in reasons):
            self.resolve()

    def defer_check(self, bad: torch.Tensor, message: str) -> None:
        """Raise ``RuntimeError(message)`` at the next ``resolve`` if ``bad`` (a device bool) is True."""
        self.deferred.append((bad, message))
        self._mark(bad)

    def _mark(self, *values) -> None:
        """The producers of these counts / flags are queued: the state's ready point moves past them."""
        dev = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
        if dev is not None:
            self.ready.mark(dev)

    def resolve(self, extra: list[torch.Tensor] = (), extra_ready=None) -> list[int]:
        """Apply the pending counts and deferred checks with one host sync for all their tensors (and
        ``extra``'s, whose values are returned). The read waits for the state's ready point (and
        ``extra_ready``, the points of ``extra``: ``checks.count_ready``), not for the whole stream; without
        ``extra_ready`` an ``extra`` is read after the whole stream."""
        return resolve_states([self], extra, extra_ready)

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

    def counted(self, batch: int, full_seq: int, seq: slice, device) -> torch.Tensor | None:
        """bool [T]: which local tokens (positions ``seq`` of a [B, S] = [batch, full_seq] micro-batch) count, in
        Megatron token order; None where every token counts (no ``token_mask``)."""
        if self.token_mask is None:
            return None
        if tuple(self.token_mask.shape) != (batch, full_seq):  # (a transposed or longer mask would fit its numel)
            raise ValueError(f"StepGuidance.token_mask has shape {tuple(self.token_mask.shape)}; the micro-batch "
                             f"needs bool [B={batch}, S={full_seq}]")
        return token_major(self.token_mask.to(device), seq)

    def cached(self, key: tuple, make):
        """``make()``, built once per step for ``key`` (index tensors every layer of the step shares)."""
        if key not in self.index_cache:
            self.index_cache[key] = make()
        return self.index_cache[key]

    def token_index(self, batch: int, full_seq: int, seq: slice, device, heads: int = 1,
                    local: slice = slice(None), of_token: bool = False) -> torch.Tensor:
        """int64 [S_local * B * g]: for each row in Megatron's order (token ``s * B + b`` of ``seq``, then the
        ``local`` heads of ``heads``, g of them) its batch-major row ([B, S, heads] flattened), or with
        ``of_token`` its batch-major token ([B, S] flattened); built once per step."""
        seq, local = seq.indices(full_seq), local.indices(heads)
        key = ("token", batch, full_seq, seq, heads, local, of_token, torch.device(device))
        return self.cached(key, lambda: _token_index(batch, full_seq, seq, device, heads, local, of_token))

    def all_valid_flags(self, n: int, device) -> torch.Tensor:
        """bool [n], all True: the valid flags of rows known (per step) to be valid; shared, never written."""
        return self.cached(("valid", n, torch.device(device)), lambda: torch.ones(n, dtype=torch.bool, device=device))


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


def resolve_states(states: list[StepState], extra: list[torch.Tensor] = (), extra_ready=None) -> list[int]:
    """``StepState.resolve`` for several states (micro-batches) with one host read for all of them."""
    taken = []
    for st in states:
        taken.append((st, list(st.pending), list(st.deferred)))
        st.pending.clear()  # in place: layer views of a state (``dataclasses.replace``) share the list
        st.deferred.clear()
    tensors = [v for _, pending, _ in taken for _, _, u, r in pending for v in (u, *r.values())
               if isinstance(v, torch.Tensor)]
    flags = [b for _, _, deferred in taken for b, _ in deferred]
    points = [st.ready for st, pending, deferred in taken if pending or deferred]
    ready = None if extra and extra_ready is None else points * bool(tensors or flags) + list(extra_ready or ())
    values = host_values(tensors + flags + list(extra), ready=ready)
    extra_values = values[len(tensors) + len(flags):]
    bad = iter(values[len(tensors): len(tensors) + len(flags)])
    failed = [msg for _, _, deferred in taken for _, msg in deferred if next(bad)]
    host = iter(values[: len(tensors)])
    val = lambda v: next(host) if isinstance(v, torch.Tensor) else int(v)  # noqa: E731
    for st, pending, _ in taken:
        for layer, site, used, reasons in pending:
            used = val(used)
            reasons = {k: n for k, n in ((k, val(v)) for k, v in reasons.items()) if n}
            st._apply(layer, site, used, reasons)
    if failed:
        raise RuntimeError("; ".join(failed))
    return extra_values


def record_to(record: Record, mv) -> Record:
    """``record`` with ``mv`` applied to each of its tensors (a device move: shapes unchanged)."""
    tensors = {f.name: mv(getattr(record, f.name)) for f in dataclasses.fields(record)
               if isinstance(getattr(record, f.name), torch.Tensor)}
    return dataclasses.replace(record, **tensors)


def site_on(c: CheckedSite, device) -> CheckedSite:
    """``c`` with its guidance tensors on ``device`` (None: left where they are); no copy where they are there."""
    if device is None:
        return c
    return _site_map(c, lambda t: to_device_async(t, device))


def site_pinned(c: CheckedSite) -> CheckedSite:
    """``c`` with its host guidance tensors in pinned memory, from where ``site_on`` copies them to a GPU without
    allocating mid-forward (those on a GPU or pinned already are kept)."""
    return _site_map(c, lambda t: t if t.is_cuda or t.is_pinned() else t.pin_memory())


def _site_map(c: CheckedSite, fn) -> CheckedSite:
    return c if c.sg is None else dataclasses.replace(c, sg=guidance_map(c.sg, fn))


def guidance_map(sg: SiteGuidance, fn, records: bool = True) -> SiteGuidance:
    """``sg`` with ``fn`` applied to its tensors: record (unless not ``records``), valid flags, expert ids."""
    mv = lambda t: t if t is None else fn(t)  # noqa: E731
    return dataclasses.replace(sg, record=record_to(sg.record, mv) if records else sg.record, valid=mv(sg.valid),
                               expert_ids=mv(sg.expert_ids))


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
    valid = sg.valid  # rows of a NaN / Inf / negative / impossible scale or amax: invalid (unless assembled)
    if not sg.scales_checked:
        valid = valid & scales_ok(SiteGuidance(mode, valid, sg.expert_ids)).to(valid.device)
    return CheckedSite(SiteGuidance(mode, valid, sg.expert_ids, scales_checked=True), None)


def _token_index(batch, full_seq, seq: tuple, device, heads, local: tuple, of_token: bool) -> torch.Tensor:
    per = 1 if of_token else heads
    rows = torch.arange(batch * full_seq * per, device=device).view(batch, full_seq, per)
    if per != heads:
        rows = rows.expand(batch, full_seq, heads)
    if seq != (0, full_seq, 1) or local != (0, heads, 1):
        rows = rows[:, slice(*seq), slice(*local)]
    return rows.transpose(0, 1).reshape(-1)


def counted_total(count: torch.Tensor | None, tokens: int):
    """Counted tokens: ``tokens`` (an int) where every token counts, else ``count.sum()``."""
    return tokens if count is None else count.sum()


def counted_sum(flags: torch.Tensor, count: torch.Tensor | None) -> torch.Tensor:
    """Set ``flags`` among the counted rows (``count`` bool, same shape or broadcastable; None: all count)."""
    return flags.sum() if count is None else (flags & count).sum()


def counted_valid(valid: torch.Tensor, count: torch.Tensor | None, token: torch.Tensor) -> torch.Tensor:
    """Counted tokens whose batch-major ``valid`` [B, S] is set; ``token``: the local tokens' rows
    (``StepState.token_index``), ``count``: bool in token order (None: every token counts)."""
    if count is None and token.numel() == valid.numel():  # every token, each once: no gather needed
        return valid.sum()
    return counted_sum(valid.reshape(-1).index_select(0, token), count)


def flat_record(record: Record, lead: int) -> Record:
    """[T, ..., K] record -> rows [N, K]: its ``lead`` leading dims (all but K) flattened (views where possible)."""
    n = math.prod(record.shape[:lead])
    return map_record(record, lambda t: t.reshape(n, *t.shape[lead:]), (n, record.shape[-1]))


def flat_rows(record: Record, valid: torch.Tensor) -> RowGuidance:
    """[T, ..., K] record -> RowGuidance over all leading dims flattened."""
    return RowGuidance(flat_record(record, valid.dim()), valid.reshape(valid.numel()))


def local_seq(hidden_seq: int, full_seq: int, tp_rank: int, sequence_parallel: bool) -> slice:
    """The positions of the full sequence this rank holds (sequence parallel shards S evenly)."""
    if sequence_parallel and hidden_seq != full_seq:
        return slice(tp_rank * hidden_seq, (tp_rank + 1) * hidden_seq)
    return slice(0, hidden_seq)


def full_from_fp4(q) -> FullGuidance:
    return q.guidance(compact=False)
