"""The quant-recipe manifest: every numeric choice, written by the trainer and checked by each rollout backend.

Checked at startup and on every weight sync: a difference is an error naming the field and both
values (USER_NEEDS.md §3-5: silent recipe drift between trainer and engine). Nothing is read from
environment variables.

The quantized-module audit (USER_NEEDS.md §5, §14) names modules canonically as in the HF
checkpoint: ``model.layers.L.mlp.experts`` (routed experts: any of the expert sites or weights)
and ``model.layers.L.self_attn.kv_cache`` (the FP4 KV cache of layer L). Both sides list what they
quantize and ``check_module_sets`` requires equal sets; exclude/include patterns use ModelOpt's
wildcard semantics (``*`` = anything, full match, never substring) and a pattern that matches no
module is an error (``match_modules``).

``TraceConfig.exclude_modules`` keeps routed experts (``model.layers.0.mlp.experts``) or KV caches
(``model.layers.0.self_attn.kv_cache``) in BF16 on both sides, e.g. boundary layers (NeMo-RL#3426):
``quantized_module_names`` leaves them out and ``excluded_modules`` (called by each side once it
knows the whole model) rejects a pattern that matches none of the quantizable modules.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .config import ACTIVATION_SITES, KV_SITES, ROLLOUT_ROUNDING, SITES, TraceConfig
from .formats import E2M1_MAX, E4M3_MAX, get_format
from .guidance.selection import guided_layers

MANIFEST_VERSION = 4
"""2: ``kv_format`` (the KV sites' format) added. 3: ``dtype`` (the dtype each side quantizes from) added. 4: fields
no quantized site uses are ``"none"`` (``activation_amax``, ``trainer_rounding``; the format's fields with K/V alone in
``sglang_kvfp4``), sites in one order."""
NVFP4_SCALE_RULE = "e4m3_rn_sat(min(448*6/amax_global,FLT_MAX)*amax_block/6)"
"""NVFP4 block scale rule as the recipe names it (S_enc saturates at FLT_MAX: ``formats.nvfp4.encode_scale``)."""


EXPERT_SITES = ("expert_fc1_in", "expert_fc2_in", "weights")
RECIPE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RecipeMismatchError(ValueError):
    """Trainer and rollout disagree on a numeric choice."""


class ModulePatternError(ValueError):
    """A module include/exclude pattern matches no module (a silent no-op otherwise)."""


def scale_rule_name(fmt: str, mxfp4_scale_rule: str) -> str:
    """A recipe's ``scale_rule`` for format ``fmt`` (NVFP4's one rule, or MXFP4's E8M0 ``mxfp4_scale_rule``)."""
    return NVFP4_SCALE_RULE if fmt == "nvfp4" else f"e8m0_{mxfp4_scale_rule}"


@dataclass(frozen=True, kw_only=True)
class QuantRecipe:
    format: str  # format, block_size, scale_dtype, scale_rule: "none" (0) where no quantized site is in the format
    kv_format: str  # the KV sites' format ("nvfp4" | "mxfp4" | "sglang_kvfp4"), "none" when K/V are not quantized
    block_size: int
    scale_dtype: str
    scale_rule: str
    e2m1_max: float
    e4m3_max: float
    weight_amax: str
    activation_amax: str  # "none" where no quantized site uses it (MXFP4; ``TraceConfig.activation_sites`` empty)
    rollout_rounding: str
    trainer_rounding: str  # "none" where no quantized site uses it (weights are RNE, SGLang's K/V ties away)
    sites: tuple[str, ...]
    guided_sites: tuple[str, ...]
    guided_layers: tuple[int, ...]
    cache_mode: str
    quantized_modules: tuple[str, ...]
    weight_version: int
    dtype: str = "bfloat16"  # the floating dtype weights and activations are in when quantized (model / params dtype)
    manifest_version: int = MANIFEST_VERSION

    @classmethod
    def from_config(
        cls, config: TraceConfig, *, guided_layers: tuple[int, ...], quantized_modules, weight_version: int = 0,
        dtype: torch.dtype = torch.bfloat16,
    ) -> QuantRecipe:
        """``dtype``: the dtype this side quantizes its expert weights and activations from (the trainer's
        parameters, the rollout model's dtype). The same inputs quantize to different codes and dequantize to
        different values in another dtype (an FP32 trainer against a BF16 rollout: USER_NEEDS.md, xtuner#2044)."""
        if dtype not in RECIPE_DTYPES:
            raise ValueError(f"dtype={dtype} is not one of {RECIPE_DTYPES}")
        fmt = get_format(config.format, config.mxfp4_scale_rule)
        nv = config.format == "nvfp4"
        kv = config.enabled and any(s in config.sites for s in KV_SITES)
        # fields of what acts nowhere are "none" (two sides differing only there compute the same): the format where
        # no quantized site is in it (K/V alone in kv_format), the activation amax and rounding without an activation
        # site quantized with activation_quantizer()
        in_fmt = config.enabled and any(s not in KV_SITES or not config.kv_format for s in config.sites)
        act = config.enabled and bool(config.activation_sites())
        return cls(
            format=config.format if in_fmt else "none",
            kv_format=config.kv_record_format if kv else "none",
            block_size=fmt.block_size if in_fmt else 0,
            scale_dtype=str(fmt.scale_dtype).removeprefix("torch.") if in_fmt else "none",
            scale_rule=scale_rule_name(config.format, config.mxfp4_scale_rule) if in_fmt else "none",
            e2m1_max=E2M1_MAX,
            e4m3_max=E4M3_MAX,
            weight_amax="per_tensor" if nv and in_fmt else "none",
            activation_amax=config.activation_amax if nv and act else "none",
            rollout_rounding=ROLLOUT_ROUNDING,
            trainer_rounding=config.rounding if act else "none",
            # (in one order: a config names a set of sites, and two orders of it quantize the same)
            sites=tuple(s for s in SITES if s in config.sites) if config.enabled else (),
            guided_sites=tuple(s for s in ACTIVATION_SITES if s in config.guided_sites) if guided_layers else (),
            guided_layers=tuple(guided_layers),
            cache_mode=config.cache_mode,
            quantized_modules=tuple(sorted(quantized_modules)),
            weight_version=int(weight_version),
            dtype=str(dtype).removeprefix("torch."),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> QuantRecipe:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise RecipeMismatchError(f"a quant recipe is a JSON object of QuantRecipe's fields, "
                                      f"not {type(d).__name__}")
        if d.get("manifest_version") != MANIFEST_VERSION:
            raise RecipeMismatchError(f"manifest_version={d.get('manifest_version')} != {MANIFEST_VERSION}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {k for k, f in fields.items() if f.default is dataclasses.MISSING}
        unknown, missing = sorted(set(d) - set(fields)), sorted(required - set(d))
        if unknown or missing:  # (the dataclass's bare TypeError named one of them, without saying which recipe)
            raise RecipeMismatchError(f"quant recipe (manifest_version={MANIFEST_VERSION}) has unknown field(s) "
                                      f"{unknown} and lacks required field(s) {missing}; "
                                      f"its fields are {sorted(fields)}")
        for k in ("sites", "guided_sites", "guided_layers", "quantized_modules"):
            d[k] = tuple(d[k])
        return cls(**d)

    def with_weight_version(self, version: int) -> QuantRecipe:
        return dataclasses.replace(self, weight_version=int(version))

    def check_matches(self, other: QuantRecipe, *, what: str = "rollout", ignore: tuple[str, ...] = ()) -> None:
        """Raise RecipeMismatchError listing every differing field (``ignore`` names fields to skip)."""
        diffs = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name not in ignore and a != b:
                diffs.append(f"{f.name}: trainer={_short(a)} {what}={_short(b)}")
        if diffs:
            raise RecipeMismatchError(f"quant recipe mismatch between trainer and {what}: " + "; ".join(diffs))


def _short(v) -> str:
    if isinstance(v, tuple) and len(v) > 6:
        return f"({len(v)} items: {', '.join(map(str, v[:3]))}, ...)"
    return repr(v)


def check_module_sets(trainer: set[str] | tuple, rollout: set[str] | tuple) -> None:
    """The quantized-module audit: both sides must quantize exactly the same modules (canonical HF names)."""
    t, r = set(trainer), set(rollout)
    if t != r:
        raise RecipeMismatchError(
            f"quantized module sets differ: only in trainer {sorted(t - r)[:8]} ({len(t - r)}), "
            f"only in rollout {sorted(r - t)[:8]} ({len(r - t)})"
        )


def check_recipe(trainer: QuantRecipe, rollout: QuantRecipe, *, what: str = "rollout",
                 ignore: tuple[str, ...] = ()) -> None:
    """``trainer.check_matches(rollout)`` with type checks: the one call a backend makes."""
    for name, r in (("trainer", trainer), (what, rollout)):
        if not isinstance(r, QuantRecipe):
            raise TypeError(f"the {name} recipe must be a QuantRecipe, got {type(r).__name__}")
    trainer.check_matches(rollout, what=what, ignore=ignore)


# ---- quantized-module audit --------------------------------------------------------------------
def experts_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def kv_cache_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_cache"


def _candidates(config: TraceConfig, moe_layers: Iterable[int], attention_layers: Iterable[int], *,
                quantizes) -> set[str]:
    names = set()
    if any(quantizes(s) for s in EXPERT_SITES):
        names |= {experts_name(i) for i in moe_layers}
    if any(quantizes(s) for s in KV_SITES):
        names |= {kv_cache_name(i) for i in attention_layers}
    return names


def quantized_module_names(config: TraceConfig, *, moe_layers: Iterable[int],
                           attention_layers: Iterable[int]) -> tuple[str, ...]:
    """Canonical names of what ``config`` quantizes in the given MoE and attention layers (sorted),
    ``config.exclude_modules`` left out."""
    names = _candidates(config, moe_layers, attention_layers, quantizes=config.quantizes)
    return tuple(sorted(n for n in names if not module_excluded(config, n)))


def excluded_modules(config: TraceConfig, *, moe_layers: Iterable[int],
                     attention_layers: Iterable[int]) -> tuple[str, ...]:
    """The modules ``config.exclude_modules`` keeps in BF16 among the whole model's quantizable ones
    (routed experts and KV caches of ``config.sites``, whether or not TRACE is enabled).

    Raises ``ModulePatternError`` naming a pattern that matches none of them (a typo, a missing
    ``model.`` prefix, a dense layer's experts): a pattern never silently does nothing."""
    if not config.exclude_modules:
        return ()
    names = _candidates(config, moe_layers, attention_layers, quantizes=lambda s: s in config.sites)
    return tuple(sorted(match_modules(sorted(names), config.exclude_modules, what="TraceConfig.exclude_modules")))


def guided_modules(config: TraceConfig, layer: int, *, moe_layers, exclusions: bool = True,
                   kv_layers=None) -> tuple[str, ...]:
    """The modules layer ``layer`` guides: a quantized guided site's module (that ``exclude_modules`` keeps in FP4,
    unless not ``exclusions``). ``kv_layers``: the layers with a KV cache (default: every layer; a hybrid model's
    linear-attention layers have none)."""
    names = set()
    for s in config.guided_sites:
        if not config.quantizes(s):
            continue
        if s in KV_SITES:
            if kv_layers is None or layer in kv_layers:
                names.add(kv_cache_name(layer))
        elif layer in moe_layers:
            names.add(experts_name(layer))
    return tuple(sorted(n for n in names if not (exclusions and module_excluded(config, n))))


def unguided_layers(config: TraceConfig, layers: list[int], *, moe_layers, exclusions: bool = True,
                    explicit: bool = False, kv_layers=None) -> list[int]:
    """The layers of the policy's ``layers`` without a guided module where that guides nothing silently: any such
    layer of an explicit list (``explicit``: ``layers`` is one whatever the policy); for another policy, all of them
    when none of its layers has one (else [])."""
    empty = [i for i in layers
             if not guided_modules(config, i, moe_layers=moe_layers, exclusions=exclusions, kv_layers=kv_layers)]
    return [] if not explicit and config.guided_layers != "explicit" and len(empty) < len(layers) else empty


def check_guided_layers(config: TraceConfig, layers: Iterable[int], *, moe_layers: Iterable[int],
                        kv_layers: Iterable[int] | None = None) -> None:
    """Raise ``ValueError`` where the layer policy's ``layers`` would guide nothing, silently: an explicit layer, or
    every layer another policy picks, without a guided module (a dense layer under expert sites only, or modules
    ``exclude_modules`` keeps in BF16, a layer without a KV cache (not in ``kv_layers``, default: every layer) under
    KV sites only). Nothing is checked without a quantized guided site."""
    layers, moe_layers = list(layers), set(moe_layers)
    kv_layers = None if kv_layers is None else set(kv_layers)
    sites = [s for s in config.guided_sites if config.quantizes(s)]
    if not layers or not sites:
        return
    empty = unguided_layers(config, layers, moe_layers=moe_layers, kv_layers=kv_layers)
    if not empty:
        return
    what = (f"guided_layer_list has layer(s) {empty}" if config.guided_layers == "explicit" else
            f"guided_layers={config.guided_layers!r} picks layer(s) {layers}")
    attn = set(empty) if kv_layers is None else set(empty) & kv_layers
    excluded = [n for i in empty for n in _candidates(config, moe_layers & {i}, attn & {i}, quantizes=config.quantizes)
                if module_excluded(config, n)]
    why = f"exclude_modules {list(config.exclude_modules)} keeps {excluded[:4]} in BF16" if excluded else \
        "they have none"
    raise ValueError(f"TraceConfig.{what}, which would guide nothing: their guided sites {sites} are in no module of "
                     f"theirs that is quantized ({why}; MoE layers: {sorted(moe_layers)}"
                     f"{'' if kv_layers is None else f', KV-cache layers: {sorted(kv_layers)}'}); guide layers whose "
                     f"modules are quantized, or narrow exclude_modules")


def batch_amax_note(config: TraceConfig, layers: Iterable[int] | None, num_layers: int) -> str | None:
    """What a trainer with ``config`` (``layers``: the layer policy's guided layers of ``num_layers``; None where the
    budget policy picks them later) rounds differently from the rollout by recipe, by name, or None: the rows of
    ``config.batch_amax_sites()`` without guidance (layers outside the policy, sites outside ``guided_sites``, rows
    whose record is missing or rejected) take the trainer's own per-tensor amax over its micro-batch."""
    sites = config.batch_amax_sites()
    if not sites:
        return None
    rows = []
    if layers is None:
        rows.append("layers outside the budget policy's")
    elif outside := sorted(set(range(num_layers)) - set(layers)):
        rows.append(f"layers {outside}")
    if unguided := [s for s in sites if s not in config.guided_sites]:
        rows.append(f"sites {unguided} outside guided_sites")
    rows.append("rows whose record is missing or rejected")
    return (f"activation_amax='per_tensor' (NVFP4): at {list(sites)} the trainer's own rounding ({', '.join(rows)}) "
            "takes one amax over its micro-batch, padding and the other samples included; the rollout took one per "
            "forward (a prefill of its batch of prompts, a decode step of its batch). There the trainer's block "
            "scales and codes differ from the rollout's by recipe and change with the padding and the batch (the RL "
            "driver's quant/<site>/scale_mismatch_rate measures them; guidance/fallback/* counts the rows at guided "
            "sites); activation_amax='per_row' (the default, batch-invariant) rounds those rows as the rollout does, "
            "bit for bit")


def module_excluded(config: TraceConfig, name: str) -> bool:
    """Whether a canonical module name is fully matched by one of ``config.exclude_modules``."""
    return any(_glob(p).fullmatch(name) for p in config.exclude_modules)


def trainer_quantized_modules(layers) -> tuple[str, ...]:
    """The trainer's list from ``megatron.find_trace_layers(model)`` (its ``moe``, ``kv``, ``config``)."""
    return quantized_module_names(layers.config, moe_layers=layers.moe, attention_layers=layers.kv)


def trainer_dtype(layers) -> torch.dtype:
    """The dtype the trainer quantizes from: its routed experts' parameters (what they fake-quantize; Megatron's
    fp32 main params live in the optimizer), else the KV layers' ``params_dtype``."""
    for m in layers.moe.values():
        for p in m.experts.parameters():
            return p.dtype
    for m in layers.kv.values():
        return m.config.params_dtype
    raise ValueError("the model has no TRACE experts or KV layers to take the dtype from")


def trainer_recipe(layers, *, weight_version: int = 0) -> QuantRecipe:
    """The trainer's recipe from ``megatron.find_trace_layers(model)`` (layer policy over its layer count).

    Under pipeline parallelism each stage lists its own layers: gather the lists before comparing."""
    return QuantRecipe.from_config(layers.config, guided_layers=guided_layers(layers.config, layers.num_layers),
                                   quantized_modules=trainer_quantized_modules(layers), weight_version=weight_version,
                                   dtype=trainer_dtype(layers))


@dataclass(frozen=True)
class ModuleAudit:
    """What one side quantizes and what it keeps in BF16 (canonical HF module names, sorted)."""

    quantized: tuple[str, ...]
    bf16: tuple[str, ...]

    def as_dict(self, prefix: str = "audit") -> dict[str, float]:
        return {f"{prefix}/quantized_modules": float(len(self.quantized)),
                f"{prefix}/bf16_modules": float(len(self.bf16))}


@functools.cache
def _glob(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", ".*"))


def match_modules(names: Iterable[str], patterns: Iterable[str], *, what: str = "exclude") -> set[str]:
    """Names fully matched by any pattern (``*`` = anything). Raises ``ModulePatternError`` for a
    pattern that matches none of ``names`` (e.g. a typo or a wrong ``model.`` prefix)."""
    names = list(names)
    hit: set[str] = set()
    for p in patterns:
        rx = _glob(p)
        got = {n for n in names if rx.fullmatch(n)}
        if not got:
            raise ModulePatternError(f"{what} pattern {p!r} matches none of the {len(names)} modules "
                                     f"(e.g. {names[:3]}); patterns are full matches with '*' wildcards")
        hit |= got
    return hit
