"""Per-layer code-mismatch rates for the budget layer policy, read from a run's metrics.jsonl.

The RL demo writes one JSON row per (arm, step) (``rl.report.MetricsWriter``) holding, on the steps it measures them
(``rl.quant_metrics_every``), ``quant/<site>/layer_<L>/code_mismatch_rate`` (``metrics.quant_metrics``): the fraction
of the (layer, site)'s recorded elements whose trainer FP4 code differs from the rollout's. ``profile_from_metrics``
averages each over one arm's last ``last`` steps that have it, then combines a layer's guided sites weighted by their
elements per token (``ModelDims``): the fraction of the layer's guided elements whose code differs, the unit
``planner.budget_layers`` takes by default. Measure it on an arm that runs FP4 without guidance (the demo's
``fp4_qat``: the trainer's own rounding against the rollout's codes); a guided arm reads about 0 at its guided layers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..config import ACTIVATION_SITES
from .model_dims import ModelDims

RATE = "code_mismatch_rate"
_LAYER_KEY = re.compile(r"/layer_(\d+)/" + RATE + "$")


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl (one JSON object per line; blank lines skipped)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not a JSON line ({e}); a metrics.jsonl has one object per line") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n} is a JSON {type(row).__name__}, not an object (a metrics row)")
        rows.append(row)
    return rows


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _pick_arm(rows: Sequence[dict], arm: str | None, prefix: str) -> str:
    has = sorted({str(r.get("arm")) for r in rows if any(k.startswith(f"{prefix}/") and _LAYER_KEY.search(k)
                                                         for k in r)})
    if arm is not None:
        if arm not in has:
            raise ValueError(f"arm={arm!r} has no per-layer {prefix}/<site>/layer_<L>/{RATE} in these metrics; "
                             f"arms that have them: {has}")
        return arm
    if len(has) != 1:
        raise ValueError(f"the metrics have per-layer {prefix}/<site>/layer_<L>/{RATE} for arms {has}: name one "
                         "(an FP4 arm without guidance, e.g. fp4_qat: a guided arm reads ~0 at its guided layers)")
    return has[0]


def profile_from_metrics(metrics: str | Path | Iterable[dict], dims: ModelDims, sites: Sequence[str], *,
                         arm: str | None = None, last: int = 3, prefix: str = "quant") -> list[float]:
    """Per-layer code-mismatch rate (``budget_layers``' default unit) of ``dims``' layers over the guided ``sites``.

    ``metrics``: a metrics.jsonl path or its rows. ``arm``: whose rows (default: the only arm with per-layer rates).
    ``last``: how many of its latest steps with a finite value are averaged, per (layer, site). A layer without any
    of ``sites`` reads 0 (guiding it guides nothing). Every (layer, site) the model has must have a value.
    """
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise ValueError(f"last={last!r} must be an int >= 1 (steps averaged)")
    if isinstance(sites, str) or not isinstance(sites, Sequence) or not sites or \
            any(s not in ACTIVATION_SITES for s in sites):
        # (no site read every layer as 0: a flat profile, silently; a str was its characters)
        raise ValueError(f"sites={sites!r} must be a non-empty list of sites from {ACTIVATION_SITES}")
    rows = read_metrics(metrics) if isinstance(metrics, str | Path) else list(metrics)
    arm = _pick_arm(rows, arm, prefix)
    mine = sorted((r for r in rows if str(r.get("arm")) == arm), key=lambda r: r.get("step", 0))  # (as _pick_arm)
    seen = {int(m.group(1)) for r in mine for k in r if k.startswith(f"{prefix}/") and (m := _LAYER_KEY.search(k))}
    if max(seen) >= dims.num_layers:
        raise ValueError(f"arm {arm!r} has {RATE} for layer(s) up to {max(seen)}, the model has {dims.num_layers} "
                         f"layers (0..{dims.num_layers - 1}): are the metrics from another model?")
    rate, missing = {}, []
    for layer in range(dims.num_layers):
        for site in sites:
            if not dims.has_site(layer, site):
                continue
            key = f"{prefix}/{site}/layer_{layer}/{RATE}"
            vals = [r[key] for r in mine if _finite(r.get(key))][-last:]
            if vals:
                rate[(layer, site)] = sum(vals) / len(vals)
            else:
                missing.append((layer, site))
    if missing:
        raise ValueError(f"arm {arm!r} has no finite {prefix}/<site>/layer_<L>/{RATE} for {len(missing)} guided "
                         f"(layer, site) pair(s), e.g. {missing[:6]}: measure every guided site of every layer "
                         f"(sites {tuple(sites)}), or plan with the sites the run measured (--sites)")
    out = []
    for layer in range(dims.num_layers):
        weights = {s: math.prod(dims.site_rows(s)) for s in sites if dims.has_site(layer, s)}
        total = sum(weights.values())
        out.append(sum(rate[(layer, s)] * w for s, w in weights.items()) / total if total else 0.0)
    return out
