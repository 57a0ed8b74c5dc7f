"""Which TRACE modules a model has, by layer id: ``find_trace_layers`` walks a model once, binds its experts to their
layer ids (``exclude_modules``), checks the layer policy against it, and caches the result on the model."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..config import TraceConfig
from ..guidance.selection import guided_layers
from ..manifest import batch_amax_note, check_guided_layers, excluded_modules
from .args_checks import moe_layer_ids
from .attention import TraceKVCore
from .experts import TraceExpertsCore
from .sharding import check_expert_sharding

logger = logging.getLogger(__name__)


@dataclass
class TraceLayers:
    """The TRACE modules of a model by layer id."""

    moe: dict[int, MoELayer]
    kv: dict[int, torch.nn.Module]
    config: TraceConfig
    num_layers: int


def find_trace_layers(model) -> TraceLayers:
    """Walk ``model`` (a module or a list of virtual-pipeline chunks) for TRACE experts and attentions.

    Multi-token-prediction layers (``model.mtp``) keep the stock spec: a TRACE module there raises, naming it.
    Also binds each experts module to its layer id, which applies ``TraceConfig.exclude_modules``
    (Megatron never tells experts their layer), hooks the torch experts' ``prepare_weights`` to the start of their
    MoE layer, and raises ``ModulePatternError`` for a pattern that matches none of the model's routed experts /
    KV caches. Call it once after building the model; later calls on the same model (chunks) return the same
    result without walking it again (``trace_guidance`` and ``check_finite`` run per step). Every call refuses
    experts sharded by a data-parallel wrapper TRACE does not support (``sharding``; a wrapper applied after the
    first call changes the parameters, not the modules)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    cached = chunks[0].__dict__.get("_trace_layers")
    if cached is not None and len(cached[0]) == len(chunks) and all(a() is b for a, b in zip(cached[0], chunks)):
        _check_sharding(cached[1])
        return cached[1]
    moe, kv, cfgs, num_layers, mtp = {}, {}, set(), 0, []
    for chunk in chunks:
        for name, m in chunk.named_modules():
            if "mtp" in name.split("."):
                if isinstance(m, (TraceExpertsCore, TraceKVCore)):
                    mtp.append(name)
                continue  # multi-token-prediction layers keep the stock spec
            if isinstance(m, MoELayer) and isinstance(m.experts, TraceExpertsCore):
                _claim(moe, m.layer_number - 1, m, name)
                cfgs.add(m.experts.trace_config)
                num_layers = m.config.num_layers
            elif isinstance(m, TraceKVCore):
                _claim(kv, m.layer_number - 1, m, name)
                cfgs.add(m.trace_config)
                num_layers = m.config.num_layers
            elif isinstance(getattr(m, "core_attention", None), TraceKVCore):  # its config has the real KV heads
                m.core_attention.trace_kv_groups = m.config.num_query_groups
    if mtp:
        raise ValueError(_MTP_REFUSED.format(names=mtp[:4], n=len(mtp)))
    if not cfgs:
        raise ValueError("the model has no TRACE modules: build it with megatron_trace.megatron's spec")
    if len(cfgs) > 1:
        raise ValueError(f"the model's TRACE modules disagree on their TraceConfig ({len(cfgs)} different)")
    layers = TraceLayers(moe, kv, cfgs.pop(), num_layers)
    _check_sharding(layers)
    _apply_exclusions(layers)
    for m in moe.values():
        m.experts.hook_moe_layer(m)  # the experts' weights quantized as their layer starts (prepare_weights)
    # not a submodule (no state_dict entry); the chunks by weak reference: chunk 0 holding itself would be a reference
    # cycle, and a dropped model (all its GPU memory) would then wait for Python's cyclic GC
    chunks[0].__dict__["_trace_layers"] = (tuple(weakref.ref(c) for c in chunks), layers)
    return layers


_MTP_REFUSED = (
    "TRACE modules in multi-token-prediction layers: {names} ({n}). MTP layers keep Megatron's stock spec, as the "
    "Megatron-LM patch builds them: no rollout engine computes them, and the module audit, exclude_modules, guidance "
    "and the NaN/Inf checks cover the decoder's layers only (these would be quantized unreported and unguided). Build "
    "mtp_block_spec from the stock layer spec, e.g. get_gpt_mtp_block_spec(config, "
    "get_gpt_decoder_layer_specs(config, ...)[-1]), not from trace_spec's")


def _check_sharding(layers: TraceLayers) -> None:
    for layer, m in layers.moe.items():
        check_expert_sharding(m.experts, f"the experts of layer {layer}")


def _apply_exclusions(layers: TraceLayers) -> None:
    """Check ``exclude_modules`` against the whole model (all pipeline stages) and tell the experts their layer."""
    cfg, mcfg = layers.config, next(iter([*layers.moe.values(), *layers.kv.values()])).config
    moe_layers = moe_layer_ids(mcfg.num_moe_experts, mcfg.moe_layer_freq, mcfg.num_layers)
    excluded_modules(cfg, moe_layers=moe_layers, attention_layers=range(layers.num_layers))
    policy = guided_layers(cfg, layers.num_layers) if cfg.guided_layers != "budget" else None  # (budget: planner)
    if policy is not None:
        check_guided_layers(cfg, policy, moe_layers=moe_layers)
    if note := batch_amax_note(cfg, policy, layers.num_layers):  # (once per model: find_trace_layers caches)
        logger.warning(note)
    for layer, m in layers.moe.items():
        m.experts.bind_trace_layer(layer)


def _claim(d: dict, layer: int, module, name: str) -> None:
    if layer in d:
        raise ValueError(f"two TRACE modules claim layer id {layer} ({name}); are MTP layers named differently?")
    d[layer] = module
