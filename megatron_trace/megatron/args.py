"""Megatron-LM launch flags: ``add_trace_args(parser)`` (an ``extra_args_provider``) and
``trace_config_from_args(args)`` -> ``TraceConfig``.

Every ``--trace-*`` flag defaults to "not given" and then takes the TraceConfig default (or the
value of ``--trace-config FILE.json``), so ``trace_args_from_config`` round-trips any config. The one exception
is ``enabled``: only ``--trace-fp4`` turns TRACE on (a file's ``"enabled"`` is ignored), so a launch script
without the flag always trains as stock Megatron.
``--trace-guided-layers`` takes a policy (none, all, last_k, fraction) or a comma list of layer ids (the
explicit policy). ``budget`` parses, but a launch refuses it: it needs measured per-layer code-mismatch rates
(``cli.plan --mismatch-profile``).
"""

from __future__ import annotations

import argparse
import json

from ..config import (
    ACTIVATION_SITES,
    CACHE_MODES,
    FALLBACKS,
    FINITE_CHECKS,
    KERNELS,
    KV_FORMATS,
    LAYER_POLICIES,
    SITES,
    TraceConfig,
)
from ..formats import FORMATS
from ..formats.mxfp4 import SCALE_RULES
from ..formats.rounding import ROUNDINGS
from ..guidance.selection import guided_layers

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


def _site_list(valid: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(s.strip() for s in text.split(",") if s.strip())
        bad = [s for s in items if s not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown site(s) {bad}; valid: {', '.join(valid)}")
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
    return ids


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
    g.add_argument("--trace-mxfp4-scale-rule", choices=SCALE_RULES, default=None)
    g.add_argument("--trace-sites", type=_site_list(SITES), default=None,
                   help=f"Comma list of quantized sites ({', '.join(SITES)}).")
    g.add_argument("--trace-activation-amax", choices=("per_row", "per_tensor"), default=None)
    g.add_argument("--trace-guided-sites", type=_site_list(ACTIVATION_SITES), default=None)
    g.add_argument("--trace-guided-layers", type=_layers, default=None,
                   help="Layer policy (none, all, last_k, fraction) or a comma list of layer ids "
                        "(budget: plan it with megatron_trace.cli.plan, pass the list it prints).")
    g.add_argument("--trace-guided-last-k", type=int, default=None)
    g.add_argument("--trace-guided-fraction", type=float, default=None)
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
    """The TraceConfig of parsed launch args, checked against the model depth (``args.num_layers``)."""
    base = {}
    if getattr(args, "trace_config", None):
        with open(args.trace_config, encoding="utf-8") as f:
            base = json.load(f)
    fields = dict(base)
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
    if fields["enabled"] and fields.get("guided_layers") == "budget":  # (before the config asks for a byte budget)
        raise ValueError(_BUDGET_AT_LAUNCH)
    try:
        cfg = TraceConfig.from_dict(fields)
    except ValueError as e:
        raise ValueError(f"invalid --trace-* flags: {e}") from None
    _check_against_model(cfg, args)
    return cfg


_BUDGET_AT_LAUNCH = (
    "--trace-guided-layers budget picks layers from measured per-layer code-mismatch rates, which a launch does not "
    "have: run `python -m megatron_trace.cli.plan --hf-config CONFIG --layer-policy budget=BYTES --mismatch-profile "
    "metrics.jsonl` (a calibration run's metrics, or a JSON list of per-layer rates) and pass the layers it prints "
    "(--trace-guided-layers 20,21,...)")


def _check_against_model(cfg: TraceConfig, args) -> None:
    num_layers = getattr(args, "num_layers", None)
    if cfg.enabled and num_layers:
        try:
            guided_layers(cfg, int(num_layers))
        except ValueError as e:
            raise ValueError(f"invalid --trace-guided-layers for --num-layers {num_layers}: {e}") from None
    replay_on = getattr(args, "moe_enable_routing_replay", None)
    if cfg.enabled and cfg.routing_replay and replay_on is False and getattr(args, "num_experts", None):
        raise ValueError("--trace-routing-replay (the default) needs Megatron's --moe-enable-routing-replay; "
                         "add it, or pass --no-trace-routing-replay")


def trace_spec_from_args(args: argparse.Namespace, spec):
    """What a Megatron-LM model builder calls: ``spec`` with TRACE modules when ``--trace-fp4`` is on
    (the same object otherwise). ``spec`` is any stock layer spec or decoder block spec."""
    from .spec import trace_spec

    cfg = trace_config_from_args(args)
    return trace_spec(spec, cfg) if cfg.enabled else spec


def trace_args_from_config(cfg: TraceConfig) -> list[str]:
    """The ``--trace-*`` flags that reproduce ``cfg`` (inverse of ``trace_config_from_args``)."""
    out = ["--trace-fp4"] if cfg.enabled else []
    for flag, name in _SIMPLE.items():
        value = getattr(cfg, name)
        opt = "--" + flag.replace("_", "-")
        if isinstance(value, bool):
            out.append(opt if value else opt.replace("--trace-", "--no-trace-"))
        else:
            out += [opt, str(value)]
    out += ["--trace-sites", ",".join(cfg.sites), "--trace-guided-sites", ",".join(cfg.guided_sites)]
    if cfg.guided_layers == "explicit":
        out += ["--trace-guided-layers", ",".join(str(i) for i in cfg.guided_layer_list)]
    else:
        out += ["--trace-guided-layers", cfg.guided_layers]
    if cfg.exclude_modules:
        out += ["--trace-exclude-modules", ",".join(cfg.exclude_modules)]
    return out
