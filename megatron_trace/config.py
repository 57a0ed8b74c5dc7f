"""``TraceConfig``: the one frozen, validated, serialisable description of a TRACE setup.

It flows from the Megatron launch flags, Hydra or Python to every consumer; nothing reads
environment variables. Layers are numbered from 0 (Megatron's ``layer_number`` minus 1).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .formats import FORMATS, Quantizer, sglang_kvfp4
from .formats.mxfp4 import SCALE_RULES
from .formats.rounding import ROUNDINGS
from .formats.sglang_kvfp4 import SGLangKVQuantizer

CONFIG_VERSION = 1

ACTIVATION_SITES = ("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v")
"""Sites whose rows the rollout records: FC1 input (per token), FC2 input (per token and expert), K, V."""
KV_SITES = ("kv_k", "kv_v")
SITES = (*ACTIVATION_SITES, "weights")
LAYER_POLICIES = ("none", "all", "last_k", "fraction", "explicit", "budget")
CACHE_MODES = ("compact", "full")
AMAX_GRANULARITIES = ("per_row", "per_tensor")
FALLBACKS = ("rne", "fail")
KERNELS = ("auto", "reference", "triton")
FINITE_CHECKS = ("deferred", "sync")
"""``TraceConfig.finite_check``: when the trainer's NaN/Inf check of quantized inputs raises: "deferred" =
at the end of the step (``trace_guidance`` exit or ``megatron.check_finite``: one host sync per step; the
values stay NaN/Inf until then), "sync" = in the quantize call itself (one host sync per call)."""
ROLLOUT_ROUNDING = "rne"
"""The rollout's rounding at every site (the recipe's ``rollout_rounding``): ``TraceConfig.rounding`` is the trainer's
own where unguided; a stochastic rollout would record codes no RNE recipe describes."""
KV_FORMATS = ("", sglang_kvfp4.NAME)
"""``TraceConfig.kv_format``: "" = K/V in ``format``; "sglang_kvfp4" = SGLang's FP4 KV cache (``fp4_e2m1``)."""
OPERATIONAL_FIELDS = ("cache_budget_mb", "cache_dir", "kernel", "finite_check")
"""``TraceConfig`` fields that change how, not what, is computed (the host cache's budget and spill directory, the
kernels, which are bit-exact twins, and when a NaN/Inf check raises): a resumed run may change them."""
_PATTERN = re.compile(r"[A-Za-z0-9_.*-]+")
"""Module patterns: canonical HF module names with ``*`` wildcards (ModelOpt semantics, full match)."""


_BOOLS = ("enabled", "ste_clip", "routing_replay")
_INTS = ("guided_last_k", "version")
_FLOATS = ("guided_fraction", "budget_bytes_per_token", "cache_budget_mb", "min_coverage")
_STRS = ("format", "kv_format", "mxfp4_scale_rule", "activation_amax", "guided_layers", "cache_mode", "cache_dir",
         "rounding", "fallback", "kernel", "finite_check")
_TUPLES = ("sites", "guided_sites", "guided_layer_list", "exclude_modules")


def _choice(name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ValueError(f"TraceConfig.{name}={value!r} is not one of {valid}")


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """Every numeric and policy choice of TRACE. See the README for each field."""

    enabled: bool = True
    format: str = "nvfp4"
    kv_format: str = ""  # "" = format; "sglang_kvfp4": K/V as SGLang's fp4_e2m1 KV cache stores them
    mxfp4_scale_rule: str = "floor"
    sites: tuple[str, ...] = SITES
    activation_amax: str = "per_row"
    guided_sites: tuple[str, ...] = ACTIVATION_SITES
    guided_layers: str = "fraction"
    guided_last_k: int = 0
    guided_fraction: float = 0.5
    guided_layer_list: tuple[int, ...] = ()
    budget_bytes_per_token: float = 0.0
    cache_mode: str = "compact"
    cache_budget_mb: float = 4096.0
    cache_dir: str = ""
    rounding: str = "rne"
    ste_clip: bool = False
    fallback: str = "rne"
    min_coverage: float = 0.0
    routing_replay: bool = True
    kernel: str = "auto"
    finite_check: str = "deferred"
    exclude_modules: tuple[str, ...] = ()  # kept BF16; see manifest.py (full-match '*' globs, none may miss)
    version: int = CONFIG_VERSION

    def __post_init__(self):
        self._check_types()
        # Hydra/OmegaConf hand lists; normalise to tuples so the config stays hashable-ish.
        for name in _TUPLES:
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.version != CONFIG_VERSION:
            raise ValueError(f"TraceConfig.version={self.version} is not supported (this build reads {CONFIG_VERSION})")
        _choice("format", self.format, FORMATS)
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"TraceConfig.kv_format={self.kv_format!r} is not one of {KV_FORMATS} (\"\" = K/V in "
                             f"TraceConfig.format; {sglang_kvfp4.NAME!r} = SGLang's fp4_e2m1 KV cache format)")
        _choice("mxfp4_scale_rule", self.mxfp4_scale_rule, SCALE_RULES)
        for name in ("sites", "guided_sites"):  # (kv_k twice, for kv_k, kv_v, left kv_v out; a layer list is a set)
            items = getattr(self, name)
            twice = sorted({i for i in items if items.count(i) > 1}, key=items.index)
            if twice:
                raise ValueError(f"TraceConfig.{name}={items} holds {twice} more than once: name each once")
        for s in self.sites:
            _choice("sites[]", s, SITES)
        for s in self.guided_sites:
            _choice("guided_sites[]", s, ACTIVATION_SITES)
            if s not in self.sites:
                raise ValueError(f"TraceConfig.guided_sites has {s!r}, which is not a quantized site {self.sites}")
        _choice("activation_amax", self.activation_amax, AMAX_GRANULARITIES)  # ignored by MXFP4 (no global amax)
        _choice("guided_layers", self.guided_layers, LAYER_POLICIES)
        _choice("cache_mode", self.cache_mode, CACHE_MODES)
        _choice("rounding", self.rounding, ROUNDINGS)
        _choice("fallback", self.fallback, FALLBACKS)
        _choice("kernel", self.kernel, KERNELS)
        _choice("finite_check", self.finite_check, FINITE_CHECKS)
        if self.guided_last_k < 0:
            raise ValueError(f"TraceConfig.guided_last_k={self.guided_last_k} must be >= 0")
        if not 0.0 <= self.guided_fraction <= 1.0:
            raise ValueError(f"TraceConfig.guided_fraction={self.guided_fraction} must be in [0, 1]")
        if any(i < 0 for i in self.guided_layer_list):
            raise ValueError(f"TraceConfig.guided_layer_list={self.guided_layer_list} has a negative layer")
        if self.guided_layers == "explicit" and not self.guided_layer_list:
            raise ValueError("TraceConfig.guided_layers='explicit' needs a non-empty guided_layer_list")
        if self.guided_layers == "last_k" and self.guided_last_k == 0:
            raise ValueError("TraceConfig.guided_layers='last_k' needs guided_last_k >= 1")
        if self.guided_layers == "fraction" and self.guided_fraction == 0:
            raise ValueError("TraceConfig.guided_layers='fraction' needs guided_fraction > 0 (0 guides no layer: "
                             "say guided_layers='none' for that)")
        if self.budget_bytes_per_token < 0:
            raise ValueError(f"TraceConfig.budget_bytes_per_token={self.budget_bytes_per_token} must be >= 0")
        if self.guided_layers == "budget" and self.budget_bytes_per_token <= 0:
            raise ValueError("TraceConfig.guided_layers='budget' needs budget_bytes_per_token > 0")
        if self.cache_budget_mb < 0:
            raise ValueError(f"TraceConfig.cache_budget_mb={self.cache_budget_mb} must be >= 0")
        if not 0.0 <= self.min_coverage <= 1.0:
            raise ValueError(f"TraceConfig.min_coverage={self.min_coverage} must be in [0, 1]")
        for p in self.exclude_modules:
            if not isinstance(p, str) or not _PATTERN.fullmatch(p):
                raise ValueError(f"TraceConfig.exclude_modules has {p!r}: a pattern is a module name such as "
                                 "'model.layers.0.mlp.experts' with '*' wildcards (letters, digits, _ - . *)")

    def _check_types(self) -> None:
        """bool / int / float / str fields of those types (a JSON "false" is not False), lists not one string."""
        def bad(name, want):
            v = getattr(self, name)
            return ValueError(f"TraceConfig.{name}={v!r} must be {want}, got {type(v).__name__}")

        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        for name in _INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, "an int")
        for name in _FLOATS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise bad(name, "a number")
            if not math.isfinite(v):  # NaN passes every ``<`` check (a NaN budget silently guides no layer)
                raise bad(name, "a finite number")
            object.__setattr__(self, name, float(v))
        for name in _STRS:
            if not isinstance(getattr(self, name), str):
                raise bad(name, "a string")
        for name in _TUPLES:
            if isinstance(getattr(self, name), str | bytes):
                raise bad(name, "a list (not one string)")
        ids = list(self.guided_layer_list)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError(f"TraceConfig.guided_layer_list={ids!r} must hold int layer ids")

    # ---- quantizers -------------------------------------------------------------------------
    def weight_quantizer(self) -> Quantizer:
        """Weights: per-tensor global amax, RNE (deterministic, identical on both sides)."""
        return Quantizer(fmt=self.format, scale_rule=self.mxfp4_scale_rule, ste_clip=self.ste_clip)

    def activation_quantizer(self, *, rollout: bool = False) -> Quantizer:
        """Activations and KV: per-row (or per-tensor) amax, the trainer's own rounding where unguided;
        ``rollout=True``: the rollout's, which rounds ``ROLLOUT_ROUNDING`` whatever ``rounding`` says."""
        per_row = self.format == "nvfp4" and self.activation_amax == "per_row"
        return Quantizer(
            fmt=self.format, per_row=per_row, scale_rule=self.mxfp4_scale_rule,
            rounding=ROLLOUT_ROUNDING if rollout else self.rounding, ste_clip=self.ste_clip,
        )

    @property
    def kv_record_format(self) -> str:
        """The format of K/V at the KV sites (quantized, recorded and accepted as guidance)."""
        return self.kv_format or self.format

    def kv_quantizer(self, *, rollout: bool = False) -> Quantizer | SGLangKVQuantizer:
        """The KV sites' quantizer: ``activation_quantizer(rollout=rollout)``, or SGLang's format for
        ``kv_format="sglang_kvfp4"``."""
        if self.kv_format == sglang_kvfp4.NAME:
            return SGLangKVQuantizer(ste_clip=self.ste_clip)
        return self.activation_quantizer(rollout=rollout)

    def activation_sites(self) -> tuple[str, ...]:
        """The sites of ``sites`` that quantize with ``activation_quantizer()``, the ones ``activation_amax`` and
        ``rounding`` act on: the expert activations, and K/V unless ``kv_format`` stores them in SGLang's format
        (weights are per-tensor RNE)."""
        kv = () if self.kv_format else KV_SITES
        return tuple(s for s in self.sites if s in ("expert_fc1_in", "expert_fc2_in", *kv))

    def batch_amax_sites(self) -> tuple[str, ...]:
        """The quantized activation sites whose own rounding (rows without a usable record) takes one NVFP4 amax over
        all the rows of a forward (``activation_amax="per_tensor"``): the trainer's over its micro-batch, padding and
        the other samples included; the rollout's over each of its forwards (a prefill of its batch of prompts, a
        decode step of its batch). The two never take it over the same rows, so there the trainer's own codes and
        scales differ from the rollout's by recipe (``manifest.batch_amax_note`` says where). () with the per-row
        amax (batch-invariant: the own rounding is the rollout's bit for bit) or MXFP4 (no global amax)."""
        if self.format != "nvfp4" or self.activation_amax != "per_tensor":
            return ()
        return tuple(s for s in self.activation_sites() if self.quantizes(s))

    def quantizes(self, site: str) -> bool:
        _choice("site", site, SITES)
        return self.enabled and site in self.sites

    # ---- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) }
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TraceConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown TraceConfig field(s) {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**d)

    def replace(self, **changes) -> TraceConfig:
        return dataclasses.replace(self, **changes)


def register_hydra(group: str = "trace", name: str = "default") -> None:
    """Register ``TraceConfig`` as a Hydra structured config (``examples`` extra)."""
    try:
        from hydra.core.config_store import ConfigStore
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Hydra is not installed: pip install 'megatron_trace[examples]'") from e
    ConfigStore.instance().store(group=group, name=name, node=_HydraTraceConfig)


def _hydra_schema():
    """TraceConfig as a mutable dataclass for OmegaConf (lists instead of tuples), derived from its fields."""
    out = []
    for f in dataclasses.fields(TraceConfig):
        d = f.default
        if isinstance(d, tuple):
            item = int if f.name == "guided_layer_list" else str
            out.append((f.name, list[item], field(default_factory=lambda d=d: list(d))))
        else:
            out.append((f.name, type(d), field(default=d)))
    return dataclasses.make_dataclass("TraceConfigSchema", out)


_HydraTraceConfig = _hydra_schema()


def from_hydra(node) -> TraceConfig:
    """Build a validated TraceConfig from a Hydra/OmegaConf node (or a plain dict)."""
    try:
        from omegaconf import OmegaConf

        d = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    except ImportError:
        d = dict(node)
    return TraceConfig.from_dict(d)
