"""The rollout side of the quantized-module audit and of the quant-recipe manifest.

``hf_module_audit`` walks a transformers model: routed experts (and the KV cache) that the backend
quantizes versus every other module with parameters (attention projections, dense MLPs, shared
experts, router, embeddings, norms, lm_head), which stay in the model dtype, as do the experts and
KV caches named by ``TraceConfig.exclude_modules``. ``qwen3_moe_modules`` derives the same module
names from an HF config alone (for engines whose model lives in another process, e.g. SGLang);
``sglang_module_audit`` adds the checkpoint's ``exclude_modules``: a Linear the patterns do not
exclude is served in FP4 by the TRACE SGLang method, so it lands in the quantized list and the set
comparison with the trainer fails loudly (verl#7519). The SGLang method does not honour
``TraceConfig.exclude_modules`` (all routed experts are FP4 there), so its audit lists every routed
experts module and differs from a trainer that excludes some: the set check fires.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from ..config import TraceConfig
from ..manifest import (
    EXPERT_SITES,
    KV_SITES,
    ModuleAudit,
    QuantRecipe,
    experts_name,
    kv_cache_name,
    match_modules,
    module_excluded,
    quantized_module_names,
)

BF16_MODE = "bf16"


def effective_config(config: TraceConfig, mode: str) -> TraceConfig:
    """What a backend in ``mode`` actually does: BF16 mode quantizes nothing."""
    return config.replace(enabled=False) if mode == BF16_MODE else config


def hf_module_audit(model: torch.nn.Module, config: TraceConfig, *, moe_layers: Iterable[int],
                    num_layers: int) -> ModuleAudit:
    """Quantized vs BF16 modules of a transformers causal LM run with ``config`` (canonical HF names)."""
    quantized = quantized_module_names(config, moe_layers=moe_layers, attention_layers=range(num_layers))
    q = set(quantized)
    bf16 = {name for name, m in model.named_modules()
            if name and next(m.parameters(recurse=False), None) is not None and name not in q}
    if any(config.quantizes(s) for s in KV_SITES):  # KV caches kept BF16 by exclude_modules (no module of their own)
        bf16 |= {n for n in map(kv_cache_name, range(num_layers)) if module_excluded(config, n)}
    return ModuleAudit(quantized=quantized, bf16=tuple(sorted(bf16)))


def _get(cfg, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def qwen3_moe_modules(hf_config) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(MoE layer ids, names of the other 2-D-weight modules) of a Qwen3-MoE / Qwen2-MoE config.

    ``hf_config``: a dict (config.json) or a transformers config. Dense layers are those in
    ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid, as transformers builds them.
    """
    n = int(_get(hf_config, "num_hidden_layers"))
    step = int(_get(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(_get(hf_config, "mlp_only_layers", None) or ())
    shared = int(_get(hf_config, "shared_expert_intermediate_size", 0) or 0)
    experts = int(_get(hf_config, "num_experts", None) or _get(hf_config, "num_local_experts", 0) or 0)
    moe = tuple(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
    names = ["model.embed_tokens", "lm_head"]
    for i in range(n):
        p = f"model.layers.{i}"
        names += [f"{p}.self_attn.{x}_proj" for x in "qkvo"]
        if i in moe:
            names.append(f"{p}.mlp.gate")  # the router
            if shared:
                names += [f"{p}.mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")]
                names.append(f"{p}.mlp.shared_expert_gate")
        else:
            names += [f"{p}.mlp.{x}_proj" for x in ("gate", "up", "down")]
    return moe, tuple(names)


def without_kv(config: TraceConfig) -> TraceConfig:
    """``config`` minus the KV sites (an engine whose KV cache stays BF16, e.g. the SGLang backend)."""
    return config.replace(sites=tuple(s for s in config.sites if s not in KV_SITES),
                          guided_sites=tuple(s for s in config.guided_sites if s not in KV_SITES))


def sglang_module_audit(config: TraceConfig, hf_config, exclude_modules: Sequence[str] | None) -> ModuleAudit:
    """What the TRACE SGLang method quantizes for a checkpoint's ``exclude_modules`` (ModelOpt wildcards).

    Routed experts are quantized (expert sites); a 2-D-weight module not matched by an exclude
    pattern is served as an NVFP4 Linear. ``exclude_modules=None``: the checkpoint excludes every
    non-expert module (what ``export.modelopt`` writes). A pattern that matches nothing raises.
    """
    moe, others = qwen3_moe_modules(hf_config)
    excluded = set(others) if exclude_modules is None else match_modules(others, exclude_modules)
    quantized = set()
    if config.enabled and any(config.quantizes(s) for s in EXPERT_SITES):
        quantized = {experts_name(i) for i in moe}
        quantized |= {n for n in others if n not in excluded}
    return ModuleAudit(quantized=tuple(sorted(quantized)), bf16=tuple(sorted(set(others) - quantized)))


def backend_recipe(config: TraceConfig, *, guided_layers: Iterable[int], audit: ModuleAudit,
                   weight_version: int, dtype: torch.dtype = torch.bfloat16) -> QuantRecipe:
    """The recipe a rollout backend serves (``config`` as ``effective_config`` gives it; ``dtype``: the model's)."""
    return QuantRecipe.from_config(config, guided_layers=tuple(sorted(set(guided_layers))),
                                   quantized_modules=audit.quantized, weight_version=weight_version, dtype=dtype)
