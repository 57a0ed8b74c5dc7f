"""Around a training step: the experts' weights fake-quantized once for all its micro-batches
(``reuse_weight_quant``, see ``weight_reuse``) and the Megatron-LM train-step and evaluation hooks
(``trace_train_step``, ``trace_eval_start``, ``trace_eval_done``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..config import KV_SITES
from ..kernels.checks import named
from .args import trace_config_from_args
from .args_checks import check_not_modelopt
from .context import check_finite, read_finite
from .experts import TraceSequentialMLP
from .layers import find_trace_layers
from .sharding import is_sharded

logger = logging.getLogger(__name__)


@contextmanager
def reuse_weight_quant(model) -> Iterator[None]:
    """Fake-quantize the routed experts' weights once for all micro-batches run inside (gradient accumulation):
    ``with reuse_weight_quant(model): for mb in micro_batches: forward + backward``, then the optimizer step
    outside. Same gradients bit for bit (straight-through, ``TraceConfig.ste_clip=False``); the kept weights
    cost one bf16 copy of the local experts until the scope exits. Torch experts only (TE fetches its own).
    An optimizer step inside the scope is an error that is not always detected (``weight_reuse``)."""
    layers = find_trace_layers(model)
    experts = [moe.experts for moe in layers.moe.values()]
    if layers.config.ste_clip:
        raise ValueError("reuse_weight_quant needs TraceConfig.ste_clip=False (the clipped STE needs each "
                         "micro-batch's mask)")
    if any(not isinstance(e, TraceSequentialMLP) for e in experts):
        raise ValueError("reuse_weight_quant supports the torch experts (TraceSequentialMLP); TE experts fetch and "
                         "quantize their weights per call")
    if any(is_sharded(next(e.parameters())) for e in experts):
        raise ValueError("reuse_weight_quant keeps the experts' fake-quantized weights while their weights stay "
                         "where they are, and a sharded data-parallel wrapper (torch FSDP2, Megatron-FSDP) "
                         "gathers them anew in every forward: the second micro-batch would fail as if the weights "
                         "had been updated. Drop reuse_weight_quant (--trace-reuse-weight-quant) with it")
    if any(e._weight_reuse is not None for e in experts):
        raise RuntimeError("reuse_weight_quant scopes do not nest: this model is already inside one")
    try:
        for e in experts:
            e._weight_reuse = {}
        yield
    finally:
        for e in experts:
            e._weight_reuse = None


@contextmanager
def trace_train_step(args, model) -> Iterator[None]:
    """Megatron-LM's ``train_step`` around ``forward_backward_func`` (patches/): with ``--trace-fp4``, the
    micro-batches run inside ``reuse_weight_quant`` when ``--trace-reuse-weight-quant`` is given, and the step's
    deferred NaN/Inf check (``check_finite``) runs after the last backward, before the optimizer step. A step that
    raises has its counts read and reset on its way out (named in a note on its error), so that they do not fail the
    next step as if its micro-batches held them."""
    if not _traced(args, model):
        yield
        return
    find_trace_layers(model)  # binds the experts' layer ids (exclude_modules needs them) before the first forward
    try:
        with reuse_weight_quant(model) if getattr(args, "trace_reuse_weight_quant", False) else nullcontext():
            yield
    except BaseException as err:
        _reset_finite_on_failure(model, err)
        raise
    check_finite(model)


def _reset_finite_on_failure(model, err: BaseException) -> None:
    """The NaN/Inf counts of a step that raised, read and reset (one host read), named in a note on ``err``."""
    try:
        bad = read_finite(model)
    except Exception as e:  # (the device itself may be what failed: the original error is raised)
        err.add_note(f"--trace-fp4: the step's NaN/Inf counters could not be read ({type(e).__name__}: {e})")
        return
    if bad:
        err.add_note(f"--trace-fp4: the failed step's FP4 quantization inputs held NaN/Inf ({named(bad)}); read and "
                     "reset on its way out")


def trace_eval_start(args, model) -> None:
    """At the start of Megatron-LM's ``evaluate`` (patches/): with ``--trace-fp4``, the experts are told their layer
    ids (``find_trace_layers``: ``--trace-exclude-modules`` needs them) before its forward passes, as
    ``trace_train_step`` does: an evaluation may run before any training step (``--skip-train``)."""
    if _traced(args, model):
        find_trace_layers(model)


def trace_eval_done(args, model) -> None:
    """After Megatron-LM's ``evaluate`` (patches/): with ``--trace-fp4``, the NaN/Inf its forward-only passes fed to
    TRACE's FP4 sites (counted on the device by the Triton quantizers; the reference raises at once) are logged as
    an error naming each site, and the counts reset (one host read), so that the next training step's check does not
    report them as its own. Evaluation goes on, as Megatron's does for a NaN loss (its evaluation loss shows it)."""
    if not _traced(args, model):
        return
    bad = read_finite(model)
    if bad:
        logger.error("--trace-fp4: FP4 quantization inputs held NaN/Inf in evaluation (%s); FP4 has no NaN/Inf: the "
                     "values were passed through unquantized", named(bad))


def _traced(args, model) -> bool:
    """Whether the Megatron-LM hooks have TRACE work on this pipeline stage: ``--trace-fp4`` is on and the stage holds
    TRACE modules (``_stage_has_sites``). A ModelOpt model is refused here: its builder skips gpt_builder's checks,
    and its model would fail later as "no TRACE modules"."""
    if not getattr(args, "trace_fp4", False):
        return False
    check_not_modelopt(args)
    return _stage_has_sites(args, model)


def _stage_has_sites(args, model) -> bool:
    """Whether this pipeline stage should hold TRACE modules: it has MoE decoder layers, or decoder layers and K/V
    are quantized (every layer attends). A stage of dense layers with no KV site has none, nor has a stage without
    decoder layers (a pipeline layout's embedding- or loss-only stage; MTP layers keep the stock spec), and its step
    is a plain step. Decided at the first step with these ``args`` (Megatron-LM's one namespace) and kept on chunk 0:
    not re-read every step."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    cached = chunks[0].__dict__.get("_trace_stage_has_sites")
    if cached is not None and cached[0] is args:
        return cached[1]
    decoder = [m for chunk in chunks for name, m in chunk.named_modules() if "mtp" not in name.split(".")]
    layers = any(isinstance(m, TransformerLayer) for m in decoder)
    has = any(isinstance(m, MoELayer) for m in decoder) or \
        (layers and any(site in trace_config_from_args(args).sites for site in KV_SITES))
    if not layers:
        logger.info("--trace-fp4: this pipeline stage has no decoder layer (MTP layers keep the stock spec): "
                    "nothing to check")
    elif not has:
        logger.info("--trace-fp4: this pipeline stage has no MoE layer and K/V are not quantized: nothing to check")
    chunks[0].__dict__["_trace_stage_has_sites"] = (args, has)  # (args refer to no model: no cycle)
    return has
