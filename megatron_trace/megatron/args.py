"""Megatron-LM launch flags: ``add_trace_args(parser)`` (an ``extra_args_provider``) and
``trace_config_from_args(args)`` -> ``TraceConfig``.

Every ``--trace-*`` flag defaults to "not given" and then takes the TraceConfig default (or the
value of ``--trace-config FILE.json``), so ``trace_args_from_config`` round-trips a config (below). The one exception
is ``enabled``: only ``--trace-fp4`` turns TRACE on (a file's ``"enabled"`` is ignored), so a launch script
without the flag always trains as stock Megatron.
``--trace-guided-layers`` takes a policy (none, all, last_k, fraction) or a comma list of layer ids (the
explicit policy). ``budget`` parses, but a launch refuses it: it needs measured per-layer code-mismatch rates
(``cli.plan --mismatch-profile``).

With ``--trace-fp4``, a flag given a value it would not act on is refused (``--trace-guided-last-k`` under another
policy, ``--trace-mxfp4-scale-rule`` with NVFP4, ...), and the flags are checked against Megatron's (``args_checks``:
the model they will build). Without it (TRACE off), the ``--trace-*`` flags given are logged as ignored.
``trace_args_from_config`` writes only the flags the config acts on, so a config round-trips up to fields it does not
use (e.g. the ``mxfp4_scale_rule`` of an NVFP4 config), which come back at their defaults.
"""

from __future__ import annotations

import argparse
import json
import logging

from ..config import (
    ACTIVATION_SITES,
    AMAX_GRANULARITIES,
    CACHE_MODES,
    FALLBACKS,
    FINITE_CHECKS,
    KERNELS,
    KV_FORMATS,
    KV_SITES,
    LAYER_POLICIES,
    SITES,
    TraceConfig,
)
from ..formats import FORMATS
from ..formats.mxfp4 import SCALE_RULES
from ..formats.rounding import ROUNDINGS
from .args_checks import check_against_model

logger = logging.getLogger(__name__)

# flag -> TraceConfig field for the flags that map one to one
_SIMPLE = {
    "trace_format": "format",
    "trace_kv_format": "kv_format",
    "trace_mxfp4_scale_rule": "mxfp4_scale_rule",
    "trace_activation_amax": "activation_amax",
    "trace_guided_last_k": "guided_last_k",
    "trace_guided_fraction": "guided_fraction",
    "trace_budget_bytes_per_token": "budget_bytes_per_token",
    "trace_cache_mode": "cache_mode",
    "trace_cache_budget_mb": "cache_budget_mb",
    "trace_cache_dir": "cache_dir",
    "trace_rounding": "rounding",
    "trace_ste_clip": "ste_clip",
    "trace_fallback": "fallback",
    "trace_min_coverage": "min_coverage",
    "trace_routing_replay": "routing_replay",
    "trace_kernel": "kernel",
    "trace_finite_check": "finite_check",
}

_GUIDED = "guided layers (--trace-guided-layers other than none) and guided sites (--trace-guided-sites not empty)"

# flag -> (what makes the config use its field, whether it does): given another value than the default while unused,
# the flag would do nothing
_USED_WHEN = {
    "trace_guided_last_k": ("--trace-guided-layers last_k", lambda c: c.guided_layers == "last_k"),
    "trace_guided_fraction": ("--trace-guided-layers fraction", lambda c: c.guided_layers == "fraction"),
    "trace_budget_bytes_per_token": ("--trace-guided-layers budget", lambda c: c.guided_layers == "budget"),
    "trace_mxfp4_scale_rule": ("--trace-format mxfp4", lambda c: c.format == "mxfp4"),
    "trace_activation_amax": ("--trace-format nvfp4 (MXFP4 blocks have E8M0 scales, no amax) and an activation site "
                              "in it (expert_fc1_in, expert_fc2_in, or kv_k / kv_v without --trace-kv-format)",
                              lambda c: c.format == "nvfp4" and bool(c.activation_sites())),
    "trace_kv_format": ("a KV site (kv_k, kv_v) in --trace-sites", lambda c: any(s in c.sites for s in KV_SITES)),
    # (no guided layer or no guided site: no row is guided, the coverage is 1 by definition and nothing falls back)
    "trace_fallback": (_GUIDED, lambda c: c.guided_layers != "none" and bool(c.guided_sites)),
    "trace_min_coverage": (_GUIDED, lambda c: c.guided_layers != "none" and bool(c.guided_sites)),
}
_OTHER_FLAGS = ("trace_config", "trace_sites", "trace_guided_sites", "trace_guided_layers", "trace_exclude_modules")


def _site_list(valid: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(s.strip() for s in text.split(",") if s.strip())
        bad = [s for s in items if s not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown site(s) {bad}; valid: {', '.join(valid)}")
        _no_repeats(items, text)
        return items

    return parse


def _layers(text: str):
    text = text.strip()
    if text in LAYER_POLICIES and text != "explicit":
        return text
    try:
        ids = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a policy ({', '.join(p for p in LAYER_POLICIES if p != 'explicit')}) "
            "nor a comma list of layer ids"
        ) from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"layer ids must be >= 0, got {text!r}")
    _no_repeats(ids, text)
    return ids


def _no_repeats(items: tuple, text: str) -> None:
    """A list item given twice (``kv_k,kv_k`` for ``kv_k,kv_v``?) is refused: the config would keep it twice."""
    twice = sorted({i for i in items if items.count(i) > 1}, key=items.index)
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} given twice in {text!r}")


def _patterns(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def add_trace_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--trace-*`` flags (use as Megatron-LM's ``extra_args_provider``)."""
    g = parser.add_argument_group(title="TRACE (rollout-guided FP4 QAT)")
    g.add_argument("--trace-fp4", action="store_true", help="Turn TRACE on: FP4 QAT experts + KV site.")
    g.add_argument("--trace-config", default=None, help="JSON file with a TraceConfig; flags override it.")
    g.add_argument("--trace-format", choices=FORMATS, default=None)
    g.add_argument("--trace-kv-format", choices=KV_FORMATS, default=None,
                   help="K/V format at the KV sites: '' (= --trace-format) or sglang_kvfp4 (SGLang's fp4_e2m1 KV "
                        "cache; its KV records then guide the trainer).")
    g.add_argument("--trace-mxfp4-scale-rule", choices=SCALE_RULES, default=None, help="With --trace-format mxfp4.")
    g.add_argument("--trace-sites", type=_site_list(SITES), default=None,
                   help=f"Comma list of quantized sites ({', '.join(SITES)}).")
    g.add_argument("--trace-activation-amax", choices=AMAX_GRANULARITIES, default=None,
                   help="With --trace-format nvfp4 (the default).")
    g.add_argument("--trace-guided-sites", type=_site_list(ACTIVATION_SITES), default=None)
    g.add_argument("--trace-guided-layers", type=_layers, default=None,
                   help="Layer policy (none, all, last_k, fraction) or a comma list of layer ids "
                        "(budget: plan it with megatron_trace.cli.plan, pass the list it prints).")
    g.add_argument("--trace-guided-last-k", type=int, default=None, help="With --trace-guided-layers last_k.")
    g.add_argument("--trace-guided-fraction", type=float, default=None,
                   help="With --trace-guided-layers fraction (the default).")
    g.add_argument("--trace-budget-bytes-per-token", type=float, default=None)
    g.add_argument("--trace-cache-mode", choices=CACHE_MODES, default=None)
    g.add_argument("--trace-cache-budget-mb", type=float, default=None)
    g.add_argument("--trace-cache-dir", default=None)
    g.add_argument("--trace-rounding", choices=ROUNDINGS, default=None)
    g.add_argument("--trace-ste-clip", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--trace-fallback", choices=FALLBACKS, default=None)
    g.add_argument("--trace-min-coverage", type=float, default=None)
    g.add_argument("--trace-routing-replay", action=argparse.BooleanOptionalAction, default=None,
                   help="Replay the rollout's expert choices (needs --moe-enable-routing-replay).")
    g.add_argument("--trace-kernel", choices=KERNELS, default=None)
    g.add_argument("--trace-finite-check", choices=FINITE_CHECKS, default=None,
                   help="NaN/Inf check of the FP4 QAT inputs: deferred (one host sync per step; call "
                        "megatron_trace.megatron.check_finite(model) before optimizer.step()) or sync (per call).")
    g.add_argument("--trace-reuse-weight-quant", action="store_true",
                   help="Fake-quantize the experts' weights once per optimizer step for all its micro-batches "
                        "(one bf16 copy of the local experts; needs --no-trace-ste-clip, the default; torch "
                        "experts). A training-loop option, not part of the TraceConfig.")
    g.add_argument("--trace-exclude-modules", type=_patterns, default=None,
                   help="Comma list of modules kept in BF16 on both sides, HF names with '*' "
                        "(e.g. 'model.layers.0.mlp.experts,model.layers.0.self_attn.kv_cache').")
    return parser


def trace_config_from_args(args: argparse.Namespace) -> TraceConfig:
    """The TraceConfig of parsed launch args. With ``--trace-fp4``, checked against flags that would do nothing and
    against Megatron's flags in ``args`` (``args_checks``: the model depth, MoE options, Transformer Engine, ...);
    without it (TRACE off), the ``--trace-*`` flags given are logged as ignored."""
    path = getattr(args, "trace_config", None)
    fields = _read_config_file(path) if path else {}
    fields["enabled"] = bool(getattr(args, "trace_fp4", False))
    for flag, name in _SIMPLE.items():
        if getattr(args, flag, None) is not None:
            fields[name] = getattr(args, flag)
    for flag, name in (("trace_sites", "sites"), ("trace_guided_sites", "guided_sites"),
                       ("trace_exclude_modules", "exclude_modules")):
        if getattr(args, flag, None) is not None:
            fields[name] = getattr(args, flag)
    layers = getattr(args, "trace_guided_layers", None)
    if isinstance(layers, tuple):
        fields.update(guided_layers="explicit", guided_layer_list=layers)
    elif layers is not None:
        fields["guided_layers"] = layers
    if "guided_sites" not in fields and "sites" in fields:  # guided sites default to the quantized ones
        fields["guided_sites"] = tuple(s for s in ACTIVATION_SITES if s in fields["sites"])
    elif getattr(args, "trace_sites", None) is not None and getattr(args, "trace_guided_sites", None) is None:
        _check_file_guided_sites(path, fields)
    if fields["enabled"] and fields.get("guided_layers") == "budget":  # (before the config asks for a byte budget)
        raise ValueError(_BUDGET_AT_LAUNCH)
    try:
        cfg = TraceConfig.from_dict(fields)
    except ValueError as e:
        source = f"--trace-config {path} or the --trace-* flags" if path else "--trace-* flags"
        raise ValueError(f"invalid {source}: {e}") from None
    if not cfg.enabled:
        given = _given_flags(args)
        if given:
            logger.warning("TRACE is off (no --trace-fp4): ignoring %s", " ".join(given))
        return cfg
    _check_used(cfg, args)
    check_against_model(cfg, args)
    return cfg


def _read_config_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            base = json.load(f)
    except OSError as e:
        raise ValueError(f"--trace-config {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--trace-config {path} is not JSON: {e}") from None
    if not isinstance(base, dict):
        raise ValueError(f"--trace-config {path} holds a JSON {type(base).__name__}; it must be an object of "
                         'TraceConfig fields (e.g. {"format": "mxfp4"}, as TraceConfig.to_dict() writes)')
    return base


def _check_file_guided_sites(path: str, fields: dict) -> None:
    """``--trace-sites`` narrowing a config file's sites below its ``guided_sites`` (every file ``to_dict`` writes has
    them): said with the flag that fixes it, not as the config's own error about ``guided_sites``."""
    guided = fields["guided_sites"]
    if isinstance(guided, list | tuple) and not set(guided) <= set(fields["sites"]):
        kept = ",".join(s for s in ACTIVATION_SITES if s in guided and s in fields["sites"])
        raise ValueError(f"--trace-sites {','.join(fields['sites'])} leaves out guided sites of --trace-config {path} "
                         f"(guided_sites={list(guided)}); pass --trace-guided-sites {kept or repr('')} with it")


def _given_flags(args) -> list[str]:
    """The ``--trace-*`` flags given on the command line, --trace-fp4 aside."""
    given = ["--" + d.replace("_", "-") for d in (*_SIMPLE, *_OTHER_FLAGS) if getattr(args, d, None) is not None]
    if getattr(args, "trace_reuse_weight_quant", False):
        given.append("--trace-reuse-weight-quant")
    return given


def _check_used(cfg: TraceConfig, args) -> None:
    """Refuse a flag given a value it would not act on (the policy or format that uses it is not the one chosen)."""
    defaults = TraceConfig()
    for flag, (needs, used) in _USED_WHEN.items():
        value = getattr(args, flag, None)
        if value is not None and value != getattr(defaults, _SIMPLE[flag]) and not used(cfg):
            raise ValueError(f"--{flag.replace('_', '-')} {value} would do nothing: it is used with {needs} only, "
                             f"and the config has {_what_decides(cfg, flag)}")
    sites = getattr(args, "trace_guided_sites", None)  # (its default is the quantized activation sites)
    if sites is not None and cfg.guided_layers == "none" and tuple(sites) != _default_guided_sites(cfg):
        raise ValueError(f"--trace-guided-sites {','.join(sites)!r} would do nothing: it is used with guided layers "
                         "(--trace-guided-layers other than none) only, and the config has guided_layers='none'")


def _default_guided_sites(cfg: TraceConfig) -> tuple[str, ...]:
    """The guided sites a config without ``--trace-guided-sites`` gets: its quantized activation sites."""
    return tuple(s for s in ACTIVATION_SITES if s in cfg.sites)


def _what_decides(cfg: TraceConfig, flag: str) -> str:
    if flag == "trace_activation_amax" and cfg.format == "nvfp4":
        return f"sites={','.join(cfg.sites)}" + (f" with kv_format={cfg.kv_format!r}" if cfg.kv_format else "")
    if flag in ("trace_mxfp4_scale_rule", "trace_activation_amax"):
        return f"format={cfg.format!r}"
    if flag == "trace_kv_format":
        return f"sites={','.join(cfg.sites)}"
    if flag in ("trace_fallback", "trace_min_coverage"):
        return f"guided_layers={cfg.guided_layers!r} and guided_sites={','.join(cfg.guided_sites)!r}"
    return f"guided_layers={cfg.guided_layers!r}"


_BUDGET_AT_LAUNCH = (
    "--trace-guided-layers budget picks layers from measured per-layer code-mismatch rates, which a launch does not "
    "have: run `python -m megatron_trace.cli.plan --hf-config CONFIG --layer-policy budget=BYTES --mismatch-profile "
    "metrics.jsonl` (a calibration run's metrics, or a JSON list of per-layer rates) and pass the layers it prints "
    "(--trace-guided-layers 20,21,...)")


def trace_spec_from_args(args: argparse.Namespace, spec):
    """What a Megatron-LM model builder calls: ``spec`` with TRACE modules when ``--trace-fp4`` is on
    (the same object otherwise). ``spec`` is any stock layer spec or decoder block spec."""
    from .spec import trace_spec

    cfg = trace_config_from_args(args)
    return trace_spec(spec, cfg) if cfg.enabled else spec


def trace_args_from_config(cfg: TraceConfig) -> list[str]:
    """The ``--trace-*`` flags that reproduce ``cfg`` (inverse of ``trace_config_from_args``), less those of fields
    it does not use (they would be refused with ``--trace-fp4``; they come back at their defaults)."""
    out = ["--trace-fp4"] if cfg.enabled else []
    for flag, name in _SIMPLE.items():
        if flag in _USED_WHEN and not _USED_WHEN[flag][1](cfg):
            continue
        value = getattr(cfg, name)
        opt = "--" + flag.replace("_", "-")
        if isinstance(value, bool):
            out.append(opt if value else opt.replace("--trace-", "--no-trace-"))
        else:
            out += [opt, str(value)]
    out += ["--trace-sites", ",".join(cfg.sites)]
    if cfg.guided_layers != "none":  # (under none the flag would do nothing: refused unless at its default)
        out += ["--trace-guided-sites", ",".join(cfg.guided_sites)]
    if cfg.guided_layers == "explicit":
        out += ["--trace-guided-layers", ",".join(str(i) for i in cfg.guided_layer_list)]
    else:
        out += ["--trace-guided-layers", cfg.guided_layers]
    if cfg.exclude_modules:
        out += ["--trace-exclude-modules", ",".join(cfg.exclude_modules)]
    return out
