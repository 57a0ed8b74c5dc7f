"""The few shapes of an MoE model that guidance sizes depend on, read from a Hugging Face config.

Per token and layer, the rows each activation site records (``rows x row length``):

  expert_fc1_in   1 x hidden                      (quantized once before dispatch)
  expert_fc2_in   topk x moe_ffn                  (one row per selected expert)
  kv_k, kv_v      kv_heads x head_dim each        (layers with a KV cache only)

Layers without routed experts (DeepSeek's ``first_k_dense_replace``, Qwen3-MoE's
``mlp_only_layers`` / ``decoder_sparse_step``) have no expert sites; linear-attention layers of
hybrid models (Qwen3.5 / Qwen3-Next ``layer_types`` or ``full_attention_interval``) have no KV
site. Multi-token-prediction layers (``num_nextn_predict_layers``) are not counted.

MLA (DeepSeek-V3, or ``kv_lora_rank`` present where the model type reads it): the KV cache holds one compressed
row per token, the latent ``c_kv`` (``kv_lora_rank``) concatenated with the shared RoPE key
(``qk_rope_head_dim``), as SGLang/FlashMLA (and transformers, as two one-head tensors) store it. We count it as
``kv_k`` with 1 row of ``kv_lora_rank + qk_rope_head_dim`` elements; ``kv_v`` has no rows (V is decoded from the
latent).

Which fields decide the layers is the model type's (``model_type``, as transformers builds it): a field its model
ignores is ignored here too, with a warning (``_UNUSED_FIELDS``); without a known ``model_type`` every field counts.
"""

from __future__ import annotations

import json
import logging
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import ACTIVATION_SITES, KV_SITES

logger = logging.getLogger(__name__)

_EXPERT_SITES = ("expert_fc1_in", "expert_fc2_in")
_CLASS_DEFAULTS = {
    "qwen3_moe": {"num_key_value_heads": 4},  # (head_dim: hidden_size // num_attention_heads, as its attention)
    "qwen3_5_moe_text": {"num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4},
    "qwen3_next": {"num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4},
    "deepseek_v3": {"first_k_dense_replace": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
}
"""transformers' (5.24) class defaults of the attention and layer-rule fields a config.json may leave out, by
``model_type`` (hybrid models without ``layer_types`` derive it from ``full_attention_interval``, default 4;
DeepSeek-V3 is always MLA, its first 3 layers dense)."""

_QWEN_MOE_RULE = ("mlp_only_layers", "decoder_sparse_step")
_HYBRID_RULE = ("layer_types", "full_attention_interval")
_DEEPSEEK_RULE = ("first_k_dense_replace", "moe_layer_freq", "n_routed_experts", "kv_lora_rank")
_UNUSED_FIELDS = {
    "qwen3_moe": _HYBRID_RULE + _DEEPSEEK_RULE,  # every layer is GQA attention with a KV cache
    "qwen3_5_moe_text": _QWEN_MOE_RULE + _DEEPSEEK_RULE,  # every layer has routed experts
    "qwen3_next": _DEEPSEEK_RULE,  # GQA attention; the Qwen3-MoE and hybrid rules decide
    "deepseek_v3": _QWEN_MOE_RULE + _HYBRID_RULE,  # first_k_dense_replace decides; every layer has a KV cache
}
"""Layer-rule and attention fields transformers' model of a ``model_type`` does not read (a stray
``full_attention_interval`` in a Qwen3-MoE config made 3 of 4 layers count without a KV cache, ``decoder_sparse_step``
in a Qwen3.5-MoE one dropped experts it builds; a stray ``kv_lora_rank`` in a Qwen one counted one MLA row per layer
for its per-head K/V, ``first_k_dense_replace`` dropped its first layers' experts)."""
_NO_EFFECT = {"mlp_only_layers": [], "decoder_sparse_step": 1, "full_attention_interval": 1,
              "first_k_dense_replace": 0, "moe_layer_freq": 1}
"""Values of those fields that change no layer (not warned about)."""

_KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
_NO_KV_LAYER_TYPES = ("linear_attention", "mamba")
"""``layer_types`` entries with and without a KV cache (transformers' names; ``attention`` and ``mamba``: its legacy
names of ``full_attention`` and ``linear_attention``)."""


@dataclass(frozen=True)
class ModelDims:
    """Shapes behind guidance sizes. Layers are numbered from 0."""

    num_layers: int
    hidden: int
    moe_ffn: int
    topk: int
    kv_heads: int
    head_dim: int
    moe_layers: tuple[int, ...]
    kv_layers: tuple[int, ...]
    kv_v: bool = True
    num_experts: int = 0
    name: str = ""

    def __post_init__(self):
        for f in ("num_layers", "hidden", "moe_ffn", "topk", "kv_heads", "head_dim", "num_experts"):
            v, low = getattr(self, f), 0 if f == "num_experts" else 1  # num_experts 0: unknown
            if not _is_int(v) or v < low:  # a NaN or 2.5 passes every comparison: check the type first
                raise ValueError(f"ModelDims.{f}={v!r} must be an int >= {low}")
        if not isinstance(self.kv_v, bool):
            raise ValueError(f"ModelDims.kv_v={self.kv_v!r} must be a bool")
        if self.num_experts and self.topk > self.num_experts:
            raise ValueError(f"ModelDims.topk={self.topk} exceeds num_experts={self.num_experts}")
        for f in ("moe_layers", "kv_layers"):  # (a layer 1.5 passed the range check and matched no layer)
            ids = tuple(getattr(self, f))
            bad = [i for i in ids if not _is_int(i) or not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"ModelDims.{f} has layer(s) {bad} outside 0..{self.num_layers - 1}")
            twice = sorted({i for i in ids if ids.count(i) > 1})
            if twice:  # (a MoE layer given twice was sized twice in the routing bytes)
                raise ValueError(f"ModelDims.{f}={ids} holds layer(s) {twice} more than once: name each once")

    def check_layer(self, layer) -> None:
        """A ValueError unless ``layer`` is an int layer id of this model (1.5, True, -1, 99 had no site: 0 bytes)."""
        if not _is_int(layer):
            raise ValueError(f"layer={layer!r} must be an int layer id in 0..{self.num_layers - 1}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} outside 0..{self.num_layers - 1}")

    def site_rows(self, site: str) -> tuple[int, int]:
        """(rows per token, elements per row) of ``site`` at a layer that has it."""
        if site == "expert_fc1_in":
            return 1, self.hidden
        if site == "expert_fc2_in":
            return self.topk, self.moe_ffn
        if site == "kv_k" or (site == "kv_v" and self.kv_v):
            return self.kv_heads, self.head_dim
        if site == "kv_v":
            return 0, self.head_dim
        raise ValueError(f"site={site!r} is not one of {ACTIVATION_SITES}")

    def has_site(self, layer: int, site: str) -> bool:
        self.check_layer(layer)
        if site in _EXPERT_SITES:
            return layer in self.moe_layers
        if site in KV_SITES:
            return layer in self.kv_layers and self.site_rows(site)[0] > 0
        raise ValueError(f"site={site!r} is not one of {ACTIVATION_SITES}")

    @classmethod
    def from_hf_config(cls, cfg: Mapping | str | Path) -> ModelDims:
        """Read a Qwen3-MoE / Qwen3.5-MoE / DeepSeek-V3 style ``config.json`` (dict or path)."""
        if not isinstance(cfg, Mapping):
            cfg = json.loads(Path(cfg).read_text())
        if "text_config" in cfg and "num_hidden_layers" not in cfg:  # multimodal wrappers (Qwen3.5) keep the LM
            cfg = {"model_type": f"{cfg.get('model_type')}_text", **cfg["text_config"]}  # under text_config
        return _dims_from_mapping(cfg)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _int(cfg: Mapping, name: str) -> int:
    """``cfg[name]`` as an int: an integer, or a float with an integral value (2048.0); else a ValueError naming it."""
    v = cfg[name]
    if _is_int(v) or (isinstance(v, float) and v.is_integer()):
        return int(v)
    raise ValueError(f"HF config {name}={v!r} must be an integer")


def _need(cfg: Mapping, *names: str) -> int:
    for n in names:
        if cfg.get(n) is not None:
            return _int(cfg, n)
    raise ValueError(f"HF config has none of {names}; is it an MoE decoder config? keys: {sorted(cfg)[:40]}")


def _opt(cfg: Mapping, name: str, default: int) -> int:
    """``cfg[name]`` as an int where it is set (not None or missing), else ``default``. (A 0 is refused by
    ``ModelDims``: it used to be taken as unset, 0 K/V heads planned as one per attention head.)"""
    return default if cfg.get(name) is None else _int(cfg, name)


def _kv_heads(cfg: Mapping, heads: int, defaults: Mapping) -> int:
    """``num_key_value_heads`` where the config has it (null: one per attention head, the transformers convention
    of e.g. ``DeepseekV3Config``), else its model type's class default (transformers builds the model with it)."""
    if "num_key_value_heads" in cfg:
        return _opt(cfg, "num_key_value_heads", heads)
    default = defaults.get("num_key_value_heads")
    if default is None:
        known = sorted(t for t, d in _CLASS_DEFAULTS.items() if "num_key_value_heads" in d)
        raise ValueError(f"HF config (model_type={cfg.get('model_type')!r}) has no num_key_value_heads, and that "
                         f"type's default is not known here (known: {known}); write it into "
                         "config.json")
    return default


def _rule(cfg: Mapping, name: str, default: int, low: int) -> int:
    """A layer-rule field (a step, frequency or count) where the config sets it (not None), else ``default``: an
    int >= ``low``, else a ValueError naming it (0 used to be taken as unset, where transformers divides by it; 2.5
    was truncated to 2, where transformers compares with 2.5)."""
    v = default if cfg.get(name) is None else _int(cfg, name)
    if v < low:
        raise ValueError(f"HF config {name}={v} must be an integer >= {low}")
    return v


def _moe_layers(cfg: Mapping, num_layers: int, defaults: Mapping) -> tuple[int, ...]:
    if "first_k_dense_replace" in cfg or "n_routed_experts" in cfg or "first_k_dense_replace" in defaults:  # DeepSeek
        first = _rule(cfg, "first_k_dense_replace", defaults.get("first_k_dense_replace", 0), 0)
        freq = _rule(cfg, "moe_layer_freq", 1, 1)
        return tuple(i for i in range(num_layers) if i >= first and i % freq == 0)
    dense = cfg.get("mlp_only_layers") or ()  # Qwen3-MoE rule
    if isinstance(dense, str | bytes | Mapping) or not all(_is_int(i) for i in dense):  # (["1"] matched no layer)
        raise ValueError(f"HF config mlp_only_layers={dense!r} must be a list of int layer ids")
    dense = set(dense)
    step = _rule(cfg, "decoder_sparse_step", 1, 1)
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _kv_layers(cfg: Mapping, num_layers: int, defaults: Mapping) -> tuple[int, ...]:
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers={num_layers}")
        unknown = sorted({t for t in types if t not in _KV_LAYER_TYPES and t not in _NO_KV_LAYER_TYPES}, key=str)
        if unknown:  # (a typo was counted as a layer with a KV cache)
            raise ValueError(f"HF config layer_types has {unknown}: known are {_KV_LAYER_TYPES} (a KV cache) and "
                             f"{_NO_KV_LAYER_TYPES} (none)")
        return tuple(i for i, t in enumerate(types) if t in _KV_LAYER_TYPES)
    interval = _rule(cfg, "full_attention_interval", defaults.get("full_attention_interval", 1), 1)
    return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)


def _dims_from_mapping(cfg: Mapping) -> ModelDims:
    num_layers = _need(cfg, "num_hidden_layers")
    hidden = _need(cfg, "hidden_size")
    num_experts = _need(cfg, "num_experts", "n_routed_experts", "num_local_experts")  # transformers 5 saves the last
    if num_experts < 1:
        raise ValueError(f"HF config num_experts={num_experts}: a model without routed experts has no guidance sites")
    model_type = cfg.get("model_type")
    defaults = _CLASS_DEFAULTS.get(model_type, {})
    unused = [f for f in _UNUSED_FIELDS.get(model_type, ()) if f in cfg]
    if any(cfg[f] not in (None, _NO_EFFECT.get(f)) for f in unused):
        logger.warning("HF config (model_type=%r) sets %s, which its transformers model ignores: ignored", model_type,
                       unused)
    cfg = {k: v for k, v in cfg.items() if k not in unused}
    if cfg.get("kv_lora_rank") is not None or "kv_lora_rank" in defaults:  # MLA: one latent row (module docstring)
        rank = _rule(cfg, "kv_lora_rank", defaults.get("kv_lora_rank", 0), 1)
        rope = _need(cfg, "qk_rope_head_dim") if "qk_rope_head_dim" not in defaults else \
            _opt(cfg, "qk_rope_head_dim", defaults["qk_rope_head_dim"])
        kv_heads, head_dim, kv_v = 1, rank + rope, False
    else:
        heads = _need(cfg, "num_attention_heads")
        kv_heads = _kv_heads(cfg, heads, defaults)
        head_dim = _opt(cfg, "head_dim", defaults.get("head_dim") or (hidden // heads if heads > 0 else 0))
        kv_v = True
    moe_layers = _moe_layers(cfg, num_layers, defaults)
    if not moe_layers:  # (every expert site sized 0 bytes, the routing none)
        raise ValueError(f"HF config has no layer with routed experts of its {num_layers} (first_k_dense_replace, "
                         "mlp_only_layers, decoder_sparse_step or moe_layer_freq leave none): no guidance sites")
    return ModelDims(
        num_layers=num_layers,
        hidden=hidden,
        moe_ffn=_need(cfg, "moe_intermediate_size"),
        topk=_need(cfg, "num_experts_per_tok"),
        kv_heads=kv_heads,
        head_dim=head_dim,
        moe_layers=moe_layers,
        kv_layers=_kv_layers(cfg, num_layers, defaults),
        kv_v=kv_v,
        num_experts=num_experts,
        name=str(cfg.get("_name_or_path") or cfg.get("model_type") or ""),
    )
