"""The rollout side of the quantized-module audit and of the quant-recipe manifest.

``hf_module_audit`` walks a transformers model: routed experts (and the KV cache) that the backend
quantizes versus every other module with parameters (attention projections, dense MLPs, shared
experts, router, embeddings, norms, lm_head), which stay in the model dtype, as do the experts and
KV caches named by ``TraceConfig.exclude_modules``. ``qwen3_moe_modules`` derives the same module
names from an HF config alone (for engines whose model lives in another process, e.g. SGLang);
``sglang_module_audit`` adds the checkpoint's ``exclude_modules``, read as SGLang 0.5.10 reads them
(``sglang_excluded``): a Linear the entries do not exclude is served in FP4 by the TRACE SGLang method,
so it lands in the quantized list and the set comparison with the trainer fails loudly (verl#7519); a
routed-experts entry (``model.layers.L.mlp.experts``, as ``export.modelopt`` writes for the layers
``TraceConfig.exclude_modules`` keeps) puts that FusedMoE in BF16.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch

from ..config import TraceConfig
from ..manifest import (
    EXPERT_SITES,
    KV_SITES,
    ModuleAudit,
    ModulePatternError,
    QuantRecipe,
    experts_name,
    kv_cache_name,
    module_excluded,
    quantized_module_names,
)
from .base import check_count, is_int

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


def _config_count(hf_config, key: str, default: int | None, least: int) -> int:
    """``hf_config[key]`` (``default`` where absent or None) as an int >= ``least``, else an error naming it (int()
    took 2.5 layers as 2, True as 1, "2" as 2; a decoder_sparse_step 0 was taken as 1, transformers divides by it)."""
    value = _get(hf_config, key, None)
    return check_count(f"hf_config {key}", default if value is None else value, least)


SGLANG_MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
"""The ``model_type``s (and SGLang model classes, picked by ``architectures``) whose SGLang 0.5.10 module tree the
SGLang path names: attention at ``model.layers.L.self_attn`` (its ``RadixAttention`` at ``.attn``, the capture's hook
target, in every layer) and routed experts at ``model.layers.L.mlp.experts`` on the ``mlp_only_layers`` /
``decoder_sparse_step`` rule."""
_OTHER_TREE_FIELDS = ("layer_types", "full_attention_interval", "kv_lora_rank", "first_k_dense_replace",
                      "n_routed_experts", "text_config")
"""Fields of configs whose models SGLang builds otherwise (hybrid linear attention, MLA, dense first layers, a
multimodal wrapper): a config without ``model_type`` that has one is refused too."""
_HYBRID_TREE = ("linear-attention layers (layers.L.linear_attn, no KV cache) and full attention at layers.L.attn (no "
                "self_attn module)")
_MLA_TREE = ("MLA attention (model.layers.L.self_attn.attn_mqa / attn_mha, one latent KV row) and dense first layers "
             "(first_k_dense_replace)")
_OTHER_TREES = {"qwen3_next": _HYBRID_TREE, "qwen3_5_moe_text": _HYBRID_TREE,
                "qwen3_5_moe": f"a multimodal wrapper (text_config) with {_HYBRID_TREE}",
                "deepseek_v2": _MLA_TREE, "deepseek_v3": _MLA_TREE}


def check_sglang_model_type(hf_config) -> None:
    """Refuse a config whose SGLang model is not one of ``SGLANG_MODEL_TYPES``' module tree, naming its ``model_type``
    (and ``architectures``): the capture hook (``model.layers.*.self_attn.attn``) matched no module of Qwen3-Next /
    Qwen3.5-MoE / DeepSeek-V3 (the engine started, then failed at its first forward), the audit named a K/V cache in
    each linear-attention layer and Qwen3-MoE's Linears, and no expert layer was read from a DeepSeek config."""
    model_type = _get(hf_config, "model_type", None)
    archs = _get(hf_config, "architectures", None) or []
    fields = [f for f in _OTHER_TREE_FIELDS if _get(hf_config, f, None) is not None]
    other_archs = [a for a in archs if a not in SGLANG_MODEL_TYPES.values()]
    if not other_archs and (model_type in SGLANG_MODEL_TYPES or (model_type is None and not fields)):
        return  # (transformers' and SGLang's Qwen3-MoE / Qwen2-MoE ignore a stray layer_types: ModelDims warns)
    what = _OTHER_TREES.get(model_type) or (f"fields {fields} of another module tree" if fields else
                                            "another module tree")
    raise ValueError(f"hf_config model_type={model_type!r} (architectures={list(archs)}): the SGLang path (capture "
                     f"hooks, module audit, weight sync) supports model_type in {list(SGLANG_MODEL_TYPES)} "
                     f"(architectures {list(SGLANG_MODEL_TYPES.values())}) only; SGLang 0.5.10 builds this model "
                     f"with {what}")


def qwen3_moe_modules(hf_config) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(MoE layer ids, names of the other 2-D-weight modules) of a Qwen3-MoE / Qwen2-MoE config.

    ``hf_config``: a dict (config.json) or a transformers config. Dense layers are those in
    ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid, as transformers builds them. Another architecture
    is refused by name (``check_sglang_model_type``).
    """
    check_sglang_model_type(hf_config)
    n = _config_count(hf_config, "num_hidden_layers", None, 1)
    step = _config_count(hf_config, "decoder_sparse_step", 1, 1)
    dense = _get(hf_config, "mlp_only_layers", None) or ()
    if isinstance(dense, str | bytes) or not all(is_int(i) for i in dense):  # (["0"] matched no layer id)
        raise ValueError(f"hf_config mlp_only_layers={dense!r} must be a list of int layer ids")
    dense = set(dense)
    shared = _config_count(hf_config, "shared_expert_intermediate_size", 0, 0)
    experts = _config_count(hf_config, "num_experts", 0, 0) or _config_count(hf_config, "num_local_experts", 0, 0)
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


def sglang_moe_layers(hf_config) -> tuple[int, ...]:
    """The MoE layers of a config the SGLang engine serves (``qwen3_moe_modules``'): every layer, else a ValueError.

    SGLang 0.5.10's Qwen3-MoE and Qwen2-MoE build every decoder layer with routed experts (``is_layer_sparse = True``
    in ``srt/models/qwen3_moe.py`` / ``qwen2_moe.py``; neither reads ``mlp_only_layers`` or ``decoder_sparse_step``),
    and their ``load_weights`` skip a dense layer's ``mlp.gate_proj`` / ``up_proj`` / ``down_proj`` without a word: the
    engine served such a layer with uninitialized experts while the trainer ran its dense MLP."""
    moe, _ = qwen3_moe_modules(hf_config)
    dense = sorted(set(range(_config_count(hf_config, "num_hidden_layers", None, 1))) - set(moe))
    if dense:
        rule = {k: _get(hf_config, k, None) for k in ("mlp_only_layers", "decoder_sparse_step", "num_experts")}
        model_type = _get(hf_config, "model_type", None)
        raise ValueError(f"hf_config {rule} makes layer(s) {dense} dense as transformers builds them, but SGLang "
                         f"0.5.10's {model_type!r} model builds every layer with routed experts and skips a dense "
                         "layer's MLP weights at load, silently: the SGLang path serves configs whose every layer has "
                         "routed experts only (mlp_only_layers=[], decoder_sparse_step=1)")
    return moe


def without_kv(config: TraceConfig) -> TraceConfig:
    """``config`` minus the KV sites (an engine whose KV cache stays BF16, e.g. the SGLang backend)."""
    return config.replace(sites=tuple(s for s in config.sites if s not in KV_SITES),
                          guided_sites=tuple(s for s in config.guided_sites if s not in KV_SITES))


# SGLang 0.5.10's Qwen3MoeForCausalLM.packed_modules_mapping (srt/models/qwen3_moe.py): its fused Linears' HF shards.
# Qwen2MoeForCausalLM (srt/models/qwen2_moe.py) declares none, so its exclude entries are matched against the fused
# names themselves. Routers (ReplicatedLinear(quant_config=None)), shared_expert_gate (a torch Linear), embeddings
# and lm_head (not a LinearBase) get no quant method there: BF16 whatever the list says.
SGLANG_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SGLANG_FUSED_TAILS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # is_layer_excluded's MLA set


def sglang_packed_modules(hf_config) -> dict[str, tuple[str, ...]]:
    """The SGLang model class's ``packed_modules_mapping`` for this config (Qwen2-MoE: none)."""
    return {} if _get(hf_config, "model_type", "") == "qwen2_moe" else dict(SGLANG_PACKED)


def _sglang_glob(pattern: str) -> re.Pattern:
    try:  # SGLang escapes only '.' ('*' -> '.*'); another regex character is taken as regex there too
        return re.compile(pattern.replace(".", r"\.").replace("*", ".*"))
    except re.error as e:
        raise ModulePatternError(f"exclude pattern {pattern!r} is not a valid SGLang pattern ({e}): SGLang "
                                 "compiles it as a regex with '.' literal and '*' = '.*'") from e


def sglang_layer_excluded(prefix: str, patterns: Sequence[str]) -> bool:
    """SGLang 0.5.10 ``ModelOptQuantConfig.is_layer_excluded`` (srt/layers/quantization/modelopt_quant.py), the one
    test a FusedMoE gets: a pattern fully matches the prefix or one of its dot-separated parts ('.' literal, '*' =
    anything, dots included); ``language_model.`` is also tried stripped; an MLA tail (``q_a_proj``...) is a
    substring of the prefix's last part."""
    variants = [prefix] + ([prefix.removeprefix("language_model.")] if prefix.startswith("language_model.") else [])
    for p in patterns:
        rx = _sglang_glob(p)
        if any(rx.fullmatch(v) or any(rx.fullmatch(part) for part in v.split(".")) for v in variants):
            return True
        tail = p.rsplit(".", 1)[-1]
        if tail in _SGLANG_FUSED_TAILS and any(tail in v.rsplit(".", 1)[-1] for v in variants):
            return True
    return False


def sglang_layer_skipped(prefix: str, patterns: Sequence[str], packed: Mapping[str, Sequence[str]]) -> bool:
    """SGLang 0.5.10 ``is_layer_skipped`` (srt/layers/quantization/utils.py), the Linears' other test: a pattern is
    a *substring* of the prefix, of each shard of a packed Linear (all shards must agree, else SGLang refuses the
    load), or names both halves of an unpacked ``gate_up_proj`` exactly."""
    proj = prefix.split(".")[-1]
    if proj in packed:
        shards = {s: any(p in prefix.replace(proj, s) for p in patterns) for s in packed[proj]}
        if len(set(shards.values())) > 1:
            raise ModulePatternError(f"exclude_modules {list(patterns)} exclude some shards of {prefix} but not all "
                                     f"({shards}): SGLang refuses such a checkpoint; list all or none of "
                                     f"{list(packed[proj])}")
        return any(shards.values())
    skipped = any(p in prefix for p in patterns)
    if "gate_up_proj" in prefix:
        skipped |= all(prefix.replace("gate_up_proj", s) in patterns for s in ("gate_proj", "up_proj"))
    elif "experts" in prefix:
        skipped |= any(prefix in p for p in patterns if "experts" in p)
    return skipped


def _sglang_linears(hf_config, moe: Sequence[int]) -> dict[str, tuple[str, ...]]:
    """The Linears SGLang builds with the quant config: SGLang prefix -> the canonical names it serves."""
    shared = _config_count(hf_config, "shared_expert_intermediate_size", 0, 0)
    out: dict[str, tuple[str, ...]] = {}
    for i in range(_config_count(hf_config, "num_hidden_layers", None, 1)):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.qkv_proj"] = tuple(f"{p}.self_attn.{x}_proj" for x in "qkv")
        out[f"{p}.self_attn.o_proj"] = (f"{p}.self_attn.o_proj",)
        for m in ([f"{p}.mlp.shared_expert"] if shared else []) if i in moe else [f"{p}.mlp"]:
            out[f"{m}.gate_up_proj"] = (f"{m}.gate_proj", f"{m}.up_proj")
            out[f"{m}.down_proj"] = (f"{m}.down_proj",)
    return out


def exclude_list(exclude_modules) -> list[str] | None:
    """A checkpoint's ``exclude_modules`` as a list of pattern strings (None stays None: every non-expert module);
    one string is refused, not read as its characters (each a substring of nearly every module name: every Linear
    excluded), and so is an entry that is no string."""
    if exclude_modules is None:
        return None
    if isinstance(exclude_modules, str | bytes):
        raise ModulePatternError(f"exclude_modules={exclude_modules!r} must be a list of patterns, not one string")
    try:
        patterns = list(exclude_modules)
    except TypeError as e:
        raise ModulePatternError(f"exclude_modules={exclude_modules!r} must be a list of patterns") from e
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise ModulePatternError(f"exclude_modules holds {bad!r}: each pattern must be a string")
    return patterns


def sglang_excluded(hf_config, exclude_modules: Sequence[str]) -> tuple[set[str], set[str]]:
    """(canonical names SGLang 0.5.10 serves unquantized for this exclude list, names it may quantize at all).

    A Linear is excluded by ``is_layer_excluded or is_layer_skipped`` on its SGLang prefix (fused ``qkv_proj`` /
    ``gate_up_proj``), a routed-experts FusedMoE by ``is_layer_excluded`` only (``ModelOptFp4Config`` and the TRACE
    method's ``get_quant_method``). A pattern that matches no module of the model under those rules (e.g. a
    per-expert ``model.layers.0.mlp.experts.3.gate_proj``, which SGLang ignores) raises ``ModulePatternError``."""
    exclude_modules = exclude_list(exclude_modules)
    moe, others = qwen3_moe_modules(hf_config)
    packed = sglang_packed_modules(hf_config)
    linears = _sglang_linears(hf_config, moe)
    experts = {experts_name(i) for i in moe}
    # what a pattern can name: every module's canonical name and SGLang prefix (substring tests: no FusedMoE). A
    # shard name SGLang does not test (Qwen2-MoE's q_proj) is accepted: the fused Linear then audits as quantized
    pool = sorted({*others, *experts, *linears})
    for p in exclude_modules:
        if not any(sglang_layer_excluded(n, [p]) or (p in n and n not in experts) for n in pool):
            raise ModulePatternError(f"exclude pattern {p!r} matches none of the {len(pool)} modules SGLang 0.5.10 "
                                     f"builds (e.g. {pool[:3]}), so SGLang ignores it: it matches a pattern fully "
                                     "against a module prefix or one of its dot-separated parts ('*' = anything) "
                                     "and, for Linears, as a substring")
    excluded = {e for e in experts if sglang_layer_excluded(e, exclude_modules)}
    for prefix, names in linears.items():
        if sglang_layer_excluded(prefix, exclude_modules) or sglang_layer_skipped(prefix, exclude_modules, packed):
            excluded |= set(names)
    quantizable = experts | {n for names in linears.values() for n in names}
    return excluded | (set(others) - quantizable), quantizable


def sglang_module_audit(config: TraceConfig, hf_config, exclude_modules: Sequence[str] | None) -> ModuleAudit:
    """What the TRACE SGLang method quantizes for a checkpoint's ``exclude_modules`` (as SGLang 0.5.10 reads them).

    Routed experts are quantized (expert sites) unless an entry excludes their FusedMoE; a Linear that SGLang
    quantizes at all (attention, dense and shared-expert MLPs) is served as an NVFP4 Linear unless an entry
    excludes it (``sglang_excluded``). ``exclude_modules=None``: the checkpoint excludes every non-expert module
    (what ``export.modelopt`` writes). A pattern that matches nothing raises.
    """
    moe, others = qwen3_moe_modules(hf_config)
    experts = {experts_name(i) for i in moe}
    if exclude_list(exclude_modules) is None:
        excluded, quantizable = set(others), experts | set(others)
    else:
        excluded, quantizable = sglang_excluded(hf_config, exclude_modules)
    quantized = set()
    if config.enabled and any(config.quantizes(s) for s in EXPERT_SITES):
        quantized = quantizable - excluded
    return ModuleAudit(quantized=tuple(sorted(quantized)), bf16=tuple(sorted((set(others) | experts) - quantized)))


def backend_recipe(config: TraceConfig, *, guided_layers: Iterable[int], audit: ModuleAudit,
                   weight_version: int, dtype: torch.dtype = torch.bfloat16) -> QuantRecipe:
    """The recipe a rollout backend serves (``config`` as ``effective_config`` gives it; ``dtype``: the model's)."""
    return QuantRecipe.from_config(config, guided_layers=tuple(sorted(set(guided_layers))),
                                   quantized_modules=audit.quantized, weight_version=weight_version, dtype=dtype)
