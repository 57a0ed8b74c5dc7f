"""The per-step guidance context: what an RL driver sets around the forward (and backward) of its micro-batches.

One context per micro-batch::

    for mb in micro_batches:
        step = StepGuidance(sites=assembled[mb], routing=routing[mb], counter=counter)
        with trace_guidance(model, step) as h:
            loss = model(*mb.inputs)
            loss.backward()
    log(counter.as_dict())

or one context around Megatron's schedule, with one ``StepGuidance`` per micro-batch in the order the data
iterator yields them (pipeline 1F1B and interleaved schedules included)::

    steps = [StepGuidance(sites=assembled[mb], routing=routing[mb], counter=counter) for mb in micro_batches]
    with trace_guidance(model, steps) as h:
        forward_backward_func(..., num_microbatches=len(steps), forward_only=False)

Each layer's k-th forward takes step k (``microbatch.MicroBatchQueue``); a forward beyond the steps given raises
(it would replay another micro-batch's routing and round toward its codes), and so do steps left unused.
Megatron's recompute pass is not a forward: it reuses the records and routing of the micro-batch it recomputes,
the recompute passes taking the checkpointed forwards in order. The backwards must therefore run in the order of
the forwards, as Megatron's schedules run them: not one backward of several checkpointed micro-batches' summed
losses (use a context per micro-batch there).

Guidance is keyed by layer id (Megatron ``layer_number - 1``, pipeline offset included) and
bound to the live modules found by walking the model; MTP layers keep the stock spec (a TRACE module there is
refused by ``find_trace_layers``). Every rank of an expert-parallel group must enter the context for the same step
(guided layers move guidance rows with collectives). Wrap the backward too when activations are recomputed: the
recomputed forward then reuses the same records and routing (a recompute pass outside the context of its forward
raises).
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..config import ACTIVATION_SITES, FALLBACKS, KV_SITES
from ..guidance.selection import guided_layers
from ..guidance.site import FallbackCounter, SiteGuidance, SiteKey
from ..kernels.checks import FiniteCounter, count_ready, count_tensors, raise_if_bad, read_and_reset
from .attention import KVStep
from .facts import step_facts
from .gemm import to_device_async
from .layers import TraceLayers, find_trace_layers
from .microbatch import MicroBatchQueue, check_all_ran
from .moe_step import FC1, FC2, MoEStep
from .recording import Recorder
from .step import GuidanceCoverageError, StepState, check_site, clear_checkpointing_flag, guidance_map, resolve_states

logger = logging.getLogger(__name__)


def _layer_id(x) -> bool:
    """An int >= 0, not a bool (``True`` would bind as layer 1)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass
class StepGuidance:
    """Guidance for one trainer micro-batch (batch-major [B, S, ...], see ``guidance/site.py``).

    sites: rollout records per (layer id, site). routing: rollout expert choices per layer id,
    int64 [B, S, topk] (replayed with Megatron's RouterReplay). counter: where the modules count
    used rows and fallbacks (one may be shared by micro-batches and steps: it adds up;
    ``guidance.records.assemble`` counts on its own). token_mask: bool [B, S], positions holding tokens (padding
    is not counted). fallback and min_coverage override the model's TraceConfig when given; min_coverage is
    checked on the rows of the ``trace_guidance`` context it is given to (all its micro-batches; the strictest
    value where they differ), not on a counter shared with other contexts.
    """

    sites: Mapping[SiteKey, SiteGuidance] = field(default_factory=dict)
    routing: Mapping[int, torch.Tensor] = field(default_factory=dict)
    counter: FallbackCounter = field(default_factory=FallbackCounter)
    token_mask: torch.Tensor | None = None
    fallback: str | None = None
    min_coverage: float | None = None

    def __post_init__(self):
        for key in self.sites:
            if not (isinstance(key, tuple) and len(key) == 2 and _layer_id(key[0])):
                raise ValueError(f"guidance key {key!r} must be (layer id >= 0, site)")
            if key[1] not in ACTIVATION_SITES:
                raise ValueError(f"guidance key {key!r}: site must be one of {ACTIVATION_SITES}")
            if self.sites[key] is not None and not isinstance(self.sites[key], SiteGuidance):  # (an AttributeError
                raise TypeError(f"guidance {key!r} must be a SiteGuidance (or None: missing), got "  # in the forward)
                                f"{type(self.sites[key]).__name__}")
        for layer, idx in self.routing.items():
            if not _layer_id(layer):
                raise ValueError(f"routing key {layer!r} must be a layer id >= 0 (an int)")
            if not isinstance(idx, torch.Tensor):
                raise TypeError(f"routing[{layer}] must be an int64 tensor [B, S, topk], got {type(idx).__name__}")
            if idx.dtype != torch.int64 or idx.dim() != 3:
                raise ValueError(f"routing[{layer}] must be int64 [B, S, topk], got {idx.dtype} {tuple(idx.shape)}")
        if self.fallback is not None and self.fallback not in FALLBACKS:
            raise ValueError(f"fallback={self.fallback!r} is not one of {FALLBACKS}")
        if not isinstance(self.counter, FallbackCounter):
            raise TypeError(f"counter must be a FallbackCounter, got {type(self.counter).__name__}")
        mc = self.min_coverage  # (True was a coverage of 1.0, "0.5" a bare TypeError)
        if mc is not None and (isinstance(mc, bool) or not isinstance(mc, numbers.Real) or not 0.0 <= mc <= 1.0):
            raise ValueError(f"min_coverage={mc!r} must be None or a number in [0, 1]")
        if self.token_mask is not None and self.token_mask.dtype != torch.bool:
            raise ValueError(f"token_mask must be bool [B, S], got {self.token_mask.dtype}")


class TraceStep:
    """What ``trace_guidance`` yields: the counter, per-site stats and (when recording) the records, of every
    micro-batch the context ran (``microbatch(i)``: of one)."""

    def __init__(self, states: Sequence[StepState], layers: TraceLayers, whole: bool = True):
        self.states, self.layers, self._whole = list(states), layers, whole

    def microbatch(self, i: int) -> TraceStep:
        """The same, for micro-batch ``i`` (the i-th ``StepGuidance`` given) alone."""
        n = len(self.states)
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):  # (True was micro-batch 1)
            raise TypeError(f"micro-batch index {i!r} must be an int in [-{n}, {n})")
        if not -n <= i < n:
            raise IndexError(f"micro-batch {i} of {n}: the index must be in [-{n}, {n})")
        return TraceStep([self.states[i]], self.layers, whole=len(self.states) == 1)

    @property
    def counter(self) -> FallbackCounter:
        """The StepGuidance's own counter when every micro-batch of the context shares one (it also holds what the
        caller counted into it before); else (``microbatch(i)`` of several, or micro-batches with counters of their
        own) a new ``FallbackCounter`` of this view's rows."""
        for st in self.states:
            st.resolve()
        counters = {id(st.counter): st.counter for st in self.states}
        if self._whole and len(counters) == 1:
            return next(iter(counters.values()))
        return _rows_counter(self.stats())

    def stats(self) -> dict:
        """Rows by (layer, site, reason); reason "used" for guided rows."""
        total = Counter()
        for st in self.states:
            st.resolve()
            total.update(st.stats)
        return dict(total)

    def coverage(self) -> float:
        """Used rows / rows at guided layers (rows of layers outside the policy excluded), over this context's rows
        (what ``min_coverage`` is checked on; a counter shared with other contexts may hold more)."""
        return _rows_counter(self.stats()).coverage

    def recorded(self) -> StepGuidance:
        """The codes the modules used in this step's forward, as guidance (needs ``record=True``)."""
        if len(self.states) > 1:
            raise ValueError(f"this context ran {len(self.states)} micro-batches: take each one's records with "
                             "h.microbatch(i).recorded()")
        rec = self.states[0].recorder
        if rec is None:
            raise ValueError("nothing recorded: enter trace_guidance(..., record=True)")
        return StepGuidance(sites=dict(rec.sites), routing=dict(rec.routing))


def _rows_counter(stats: Mapping) -> FallbackCounter:
    """A ``FallbackCounter`` of rows by (layer, site, reason) (``TraceStep.stats``)."""
    total = FallbackCounter()
    for (_, _, reason), v in stats.items():
        if reason == "used":
            total.add(v)
        else:
            total.add(0, {reason: v})
    return total


@contextmanager
def trace_guidance(model, step: StepGuidance | Sequence[StepGuidance] | None = None, *, record: bool = False,
                   compact: bool | None = None) -> Iterator[TraceStep]:
    """Guided rounding (where ``step`` has records), routing replay and optional recording for one step.

    ``step``: one micro-batch's guidance, or a list with one per micro-batch in the order they run (Megatron's
    ``forward_backward_func`` inside the context; see the module docstring). ``step=None`` runs the trainer's own
    rounding (and records, with ``record=True``). ``compact`` chooses the recorded kind (default: the config's
    cache_mode).
    """
    if not isinstance(record, bool) or not (compact is None or isinstance(compact, bool)):
        # ("no" is truthy: record="no" recorded, compact="no" recorded compact records)
        raise ValueError(f"trace_guidance: record={record!r} must be a bool and compact={compact!r} a bool or None "
                         "(the config's cache_mode)")
    layers = find_trace_layers(model)
    steps = _micro_batches(step)
    steps = [_on_model_device(s, layers, records=len(steps) == 1) for s in steps]
    cfg = layers.config
    states = [StepState(
        config=cfg, counter=s.counter, fallback=s.fallback or cfg.fallback,
        guided_layers=frozenset(guided_layers(cfg, layers.num_layers)), token_mask=s.token_mask,
        recorder=Recorder(cfg.cache_mode == "compact" if compact is None else compact) if record else None,
    ) for s in steps]
    _check_keys(steps, layers)
    _check_cuda_graphs(layers)
    for s in steps:
        _check_context_parallel(s, layers, record)
    if any(m.experts._trace_step is not None for m in layers.moe.values()) or any(
        m._trace_step is not None for m in layers.kv.values()
    ):
        raise RuntimeError("trace_guidance contexts do not nest: this model is already inside one")
    hooks, queues, gpu = [], [], _model_gpu(layers)
    try:
        for layer, moe in layers.moe.items():
            checkpointed = moe.moe_layer_recompute  # (recompute_modules "moe": the layer is its own checkpoint)
            q = MicroBatchQueue(layer, [
                _moe_step(_layer_state(st, moe.experts, (FC1, FC2, "weights"), checkpointed), s, layer, moe)
                for st, s in zip(states, steps)
            ], moe.experts, device=gpu, checkpointed=checkpointed)
            queues.append(q)
            hooks.append(moe.router.register_forward_pre_hook(
                lambda router, args, q=q: q.select().router_pre_hook(router, args)))
            hooks.append(moe.router.register_forward_hook(
                lambda router, args, out, q=q: q.current.router_hook(router, args, out)))
        for layer, attn in layers.kv.items():
            q = MicroBatchQueue(layer, [
                _kv_step(_layer_state(st, attn, KV_SITES), s, layer, attn) for st, s in zip(states, steps)
            ], attn, device=gpu)
            queues.append(q)
            hooks.append(attn.register_forward_pre_hook(q.pre_hook))
        step_facts([st for q in queues for st in q.steps])
        handle = TraceStep(states, layers)
        yield handle
        check_all_ran(queues)
    except BaseException:
        read_and_reset(_finite_counters(layers))  # this step's NaN/Inf counts must not fail the next step
        clear_checkpointing_flag()  # (an error inside a checkpoint's first pass leaves it set)
        raise
    finally:
        for h in hooks:
            h.remove()
        for q in queues:
            q.close()
        for moe in layers.moe.values():
            rr = moe.router.router_replay
            if rr is not None:
                rr.clear_indices()
                rr.clear_router_replay_action()
    counters = _finite_counters(layers)
    # one read: row counts, deferred checks, NaN/Inf counts, after their producers (not the whole backward)
    try:
        counts = resolve_states(states, extra=count_tensors(counters), extra_ready=count_ready(counters))
    except BaseException:
        read_and_reset(counters)
        raise
    raise_if_bad(counters, when="in this trace_guidance step", counts=counts)  # (NaN/Inf before coverage)
    _check_coverage(handle, steps)


def _micro_batches(step) -> list[StepGuidance]:
    if step is None:
        return [StepGuidance()]
    if isinstance(step, StepGuidance):
        return [step]
    if isinstance(step, (str, bytes, Mapping)) or not isinstance(step, Sequence):
        raise TypeError(f"trace_guidance takes a StepGuidance, a list of them (one per micro-batch) or None, got "
                        f"{type(step).__name__}")
    steps = list(step)
    if not steps:
        raise ValueError("trace_guidance got an empty list of micro-batches' guidance")
    bad = [type(s).__name__ for s in steps if not isinstance(s, StepGuidance)]
    if bad:
        raise TypeError(f"trace_guidance's list must hold StepGuidance objects, got {bad[:3]}")
    return steps


def _check_context_parallel(step: StepGuidance, layers: TraceLayers, record: bool) -> None:
    """Guidance, routing, recorded and masked rows are taken as contiguous sequence shards: context parallelism (its
    load-balanced chunks are not contiguous) is refused when the step carries any or records (the records would be
    laid out at the wrong positions)."""
    modules = [*layers.moe.values(), *layers.kv.values()]
    cp = max((getattr(m.config, "context_parallel_size", 1) or 1 for m in modules), default=1)
    if cp > 1 and (step.sites or step.routing or record or step.token_mask is not None):
        raise ValueError(f"context_parallel_size={cp}: guidance, routing replay, recording and token masks take each "
                         "rank's tokens as one contiguous shard, which context parallelism's chunks are not (not "
                         "supported yet; the trainer's own rounding alone is)")


def _check_cuda_graphs(layers: TraceLayers) -> None:
    """Megatron's CUDA graphs (``cuda_graph_impl`` "local"; "transformer_engine" in training mode only) replay the
    parts of a layer their ``cuda_graph_scope`` names without running their Python forward, so the hooks that give
    each forward its micro-batch's guidance, routing replay, records and counts (on the core attention's KV site and
    the MoE router) would not run: the graph would replay what it captured, uncounted. Refused where the scope covers
    them."""
    graphed = [f"layer {i}'s KV site" for i, m in layers.kv.items() if _graphed(m, ("attn",))]
    graphed += [f"layer {i}'s MoE router" for i, m in layers.moe.items() if _graphed(m, ("moe_router", "moe"))]
    if not graphed:
        return
    cfg = next(iter([*layers.kv.values(), *layers.moe.values()])).config
    scope = [getattr(s, "name", s) for s in cfg.cuda_graph_scope or ()] or "(the whole layer)"
    raise ValueError(
        f"trace_guidance needs the TRACE modules' forwards to run eagerly, but cuda_graph_impl={cfg.cuda_graph_impl!r} "
        f"with cuda_graph_scope {scope} replays {', '.join(graphed[:4])} ({len(graphed)} in all) as captured: their "
        "per-micro-batch guidance, routing replay, recording and counts would be skipped. Use cuda_graph_impl='none', "
        "or a cuda_graph_scope without the attention (attn) and the MoE router (moe_router, moe) of the TRACE layers "
        "(Megatron-LM: --cuda-graph-impl none, or --cuda-graph-scope)")


def _graphed(module, scopes: tuple[str, ...]) -> bool:
    """Whether Megatron's CUDA graphs replay ``module`` (of a layer part in any of ``scopes``; an empty scope list:
    the whole layer; ``full_iteration``: everything). Transformer Engine's graphs replay training-mode forwards only
    (``MegatronModule._should_call_te_cudagraph``): an evaluation forward runs eagerly."""
    config = module.config
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "none" or (impl == "transformer_engine" and not module.training):
        return False
    names = [getattr(s, "name", s) for s in config.cuda_graph_scope or ()]
    return not names or "full_iteration" in names or any(s in names for s in scopes)


def guidance_to(step: StepGuidance, device, layers=None, records: bool = True) -> StepGuidance:
    """``step`` with every tensor on ``device`` (records, valid flags, expert ids, routing, token mask; only those
    of ``layers`` when given; the records left where they are without ``records``); host tensors go to a GPU from
    pinned memory without blocking the host. Same counter object."""
    device = torch.device(device)
    mv = lambda t: t if t is None else to_device_async(t, device)  # noqa: E731
    held = (lambda layer: True) if layers is None else set(layers).__contains__
    sites = {key: guidance_map(sg, mv, records) if held(key[0]) else sg for key, sg in step.sites.items()}
    routing = {layer: mv(r) if held(layer) else r for layer, r in step.routing.items()}
    return dataclasses.replace(step, sites=sites, routing=routing, token_mask=mv(step.token_mask))


def _model_gpu(layers: TraceLayers) -> torch.device | None:
    """The GPU the TRACE modules' parameters are on (None: not on a GPU)."""
    modules = [*layers.moe.values(), *layers.kv.values()]
    device = next((p.device for m in modules for p in m.parameters()), None)
    return device if device is not None and device.type == "cuda" else None


def _on_model_device(step: StepGuidance, layers: TraceLayers, records: bool = True) -> StepGuidance:
    """Host guidance (e.g. assembled from the host cache) copied to the model's GPU once, at the context entry:
    the forward's own copies from pageable memory would each wait for the stream, mid-forward. Without
    ``records`` (several micro-batches) the records stay on the host: ``MicroBatchQueue`` pins them once, after
    the steps' checks, and each layer brings its own to the GPU as its forward of that micro-batch begins, so the
    GPU never holds every micro-batch's (pinned, not by each layer mid-forward: allocating pinned memory can wait
    for the device)."""
    device = _model_gpu(layers)
    if device is None:
        return step
    return guidance_to(step, device, layers=(*layers.moe, *layers.kv), records=records)


def check_finite(model) -> None:
    """Raise ``NonFiniteError`` naming every TRACE site whose inputs held NaN/Inf since the last check.

    With ``TraceConfig.finite_check="deferred"`` (the default) the quantizers only count NaN/Inf on the
    device (their outputs stay NaN/Inf); ``trace_guidance`` checks at its exit, and a training loop without
    it (plain FP4 QAT) calls this before ``optimizer.step()``: one host read for the whole model, which waits
    for the kernels that counted (the forward's) on a side stream, not for the rest of the backward, so the GPU
    is not drained before the optimizer's launches (``checks.ReadyPoint``)."""
    raise_if_bad(_finite_counters(find_trace_layers(model)), when="since the last check")


def read_finite(model) -> list[tuple[str, int]]:
    """(site, count) of every TRACE site whose inputs held NaN/Inf since the last check, read (one host read) and
    reset: ``check_finite`` without the raise, for a caller that reports them itself."""
    return [(label, n) for label, n in read_and_reset(_finite_counters(find_trace_layers(model))) if n]


def _finite_counters(layers: TraceLayers) -> list[FiniteCounter]:
    modules = [*(moe.experts for moe in layers.moe.values()), *layers.kv.values()]
    return [c for m in modules for c in m._finite.values() if isinstance(c, FiniteCounter)]


def trace_record(model, *, compact: bool | None = None):
    """Run the trainer's own rounding and record it: ``with trace_record(m) as h: ...; h.recorded()``."""
    return trace_guidance(model, None, record=True, compact=compact)


def _check_keys(steps: list[StepGuidance], layers: TraceLayers) -> None:
    """Keys no module of this rank uses are logged (once for all micro-batches); routing missing for a MoE layer of
    this rank raises, naming the micro-batch when there are several."""
    known = set(layers.moe) | set(layers.kv)
    sites = {k for step in steps for k in step.sites}
    routed = {k for step in steps for k in step.routing}
    stray = sorted({k[0] for k in sites if k[0] not in known} | {k for k in routed if k not in layers.moe})
    outside = [k for k in stray if k >= layers.num_layers]
    unused = sorted(k for k in sites if not layers.config.quantizes(k[1]))
    if outside or unused:  # keys no rank of this model can use: a producer/consumer mismatch
        logger.warning("guidance keys that match no TRACE module are ignored: layers %s outside 0..%d, "
                       "sites not quantized %s", outside, layers.num_layers - 1, unused[:8])
    if stray:  # normal under pipeline parallelism: other stages hold these layers
        logger.debug("guidance for layers this rank does not hold is ignored: %s", stray)
    if routed and not layers.config.routing_replay:
        logger.warning("routing indices are ignored: TraceConfig.routing_replay=False")
        return
    for i, step in enumerate(steps):
        missing = sorted(set(layers.moe) - set(step.routing)) if step.routing else []
        if missing:
            which = f"micro-batch {i}: " if len(steps) > 1 else ""
            raise ValueError(f"{which}routing indices are missing for MoE layers {missing} (given for "
                             f"{sorted(step.routing)})")


def _layer_state(state: StepState, module, sites: tuple[str, ...], checkpointed: bool = False) -> StepState:
    """``state`` as seen by a layer whose ``sites`` (of ``module``) ``exclude_modules`` keeps in BF16: without
    them (no guidance counted, checked or recorded there); ``checkpointed``: the layer runs inside its own
    activation checkpoint (``StepState.checkpointed``). Counter, stats and recorder are shared."""
    cfg = state.config
    kept = tuple(s for s in cfg.sites if s not in sites or module.trace_quantizes(s))
    if kept != cfg.sites:
        state = dataclasses.replace(state, config=cfg.replace(
            sites=kept, guided_sites=tuple(s for s in cfg.guided_sites if s in kept)))
    return dataclasses.replace(state, checkpointed=True) if checkpointed else state


def _moe_step(state: StepState, step: StepGuidance, layer: int, moe: MoELayer) -> MoEStep:
    mcfg, fail = moe.config, state.fallback == "fail"
    routing = step.routing.get(layer) if state.config.routing_replay else None
    if routing is not None:
        if moe.router.router_replay is None:
            raise ValueError("routing replay needs TransformerConfig.moe_enable_routing_replay=True "
                             "(Megatron-LM: --moe-enable-routing-replay)")
        if mcfg.moe_router_fusion:
            raise ValueError("routing replay does not work with moe_router_fusion=True")
    if state.recorder is not None and moe.attn_tp_group.size() > 1:
        raise ValueError("recording needs tensor_model_parallel_size=1")
    dims = {FC1: (mcfg.hidden_size,), FC2: (mcfg.moe_router_topk, mcfg.moe_ffn_hidden_size)}
    checked = {
        s: check_site(step.sites.get((layer, s)), site=s, layer=layer, rows=dims[s], config=state.config,
                      compact=state.compact, fail=fail and state.is_guided(layer, s))
        for s in (FC1, FC2)
    }
    ms = MoEStep(state, layer, moe, checked[FC1], checked[FC2], routing)
    if ms.needs_dispatch and getattr(mcfg, "overlap_moe_expert_parallel_comm", False):
        raise ValueError("guidance rows (and recording) are not supported with overlap_moe_expert_parallel_comm=True: "
                         "its schedule runs the MoE layer's dispatch and experts as separate pieces on their own "
                         "streams, which the guidance rows' dispatch has not been verified against")
    if ms.needs_dispatch and (mcfg.moe_expert_capacity_factor is not None or mcfg.moe_router_padding_for_quantization):
        raise ValueError("guidance rows follow the tokens only in dropless MoE "
                         "(moe_expert_capacity_factor=None, moe_router_padding_for_quantization=False)")
    return ms


def _kv_step(state: StepState, step: StepGuidance, layer: int, attn) -> KVStep:
    heads, first = attn.kv_heads()
    if state.recorder is not None and (attn.config.tensor_model_parallel_size or 1) > 1:
        raise ValueError("recording needs tensor_model_parallel_size=1 (a rank holds only its KV heads)")
    rows = (heads, attn.config.kv_channels)
    checked = {
        s: check_site(step.sites.get((layer, s)), site=s, layer=layer, rows=rows, config=state.config,
                      compact=state.compact, fail=state.fallback == "fail" and state.is_guided(layer, s))
        for s in KV_SITES
    }
    return KVStep(state, layer, checked, first)


def _check_coverage(handle: TraceStep, steps: list[StepGuidance]) -> None:
    """``min_coverage`` (the strictest a StepGuidance gives, else the config's) over the context's rows: one
    micro-batch, or all the micro-batches of a list."""
    given = [s.min_coverage for s in steps if s.min_coverage is not None]
    need = max(given) if given else handle.layers.config.min_coverage
    cov = handle.coverage()
    if cov < need:
        raise GuidanceCoverageError(f"guidance coverage {cov:.4f} at guided sites is below min_coverage={need}")
