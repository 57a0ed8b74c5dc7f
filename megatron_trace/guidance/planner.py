"""Planning guidance sizes: the budget layer policy and the per-policy size table behind ``plan``.

``budget_layers`` picks the layers that remove the most mismatch per byte: layers sorted by
``mismatch / bytes`` (deeper first on ties), each taken if it still fits under
``config.budget_bytes_per_token``. The budget is never exceeded. The mismatch profile is the
per-layer code-mismatch mass measured in a calibration step (METRICS.md
``quant/code_mismatch_rate`` per layer, weighted by the guided elements if sites differ); a
layer with zero measured mismatch is not taken (guiding it removes nothing).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..config import TraceConfig
from .accounting import bytes_per_layer, bytes_per_token, config_fmt_kw
from .model_dims import ModelDims
from .selection import guided_layers

logger = logging.getLogger(__name__)


def _per_layer(value, num_layers: int, what: str, cast) -> list:
    if value is None:
        raise ValueError(
            f"the budget layer policy needs {what} for each of the {num_layers} layers "
            "(measure quant/code_mismatch_rate per layer in a calibration step, METRICS.md)"
        )
    if isinstance(value, Mapping):
        missing = sorted(set(range(num_layers)) - set(value))
        extra = sorted(set(value) - set(range(num_layers)))
        if missing or extra:
            raise ValueError(f"{what} must have keys 0..{num_layers - 1}: missing {missing}, unknown {extra}")
        vals = [cast(value[i]) for i in range(num_layers)]
    elif isinstance(value, int | float):
        vals = [cast(value)] * num_layers
    else:
        vals = [cast(v) for v in value]
        if len(vals) != num_layers:
            raise ValueError(f"{what} has {len(vals)} entries, expected num_layers={num_layers}")
    bad = [(i, v) for i, v in enumerate(vals) if not math.isfinite(v) or v < 0]
    if bad:
        raise ValueError(f"{what} must be finite and >= 0; bad (layer, value): {bad[:5]}")
    return vals


def budget_layers(
    config: TraceConfig,
    num_layers: int,
    *,
    mismatch_profile: Mapping[int, float] | Sequence[float] | None = None,
    bytes_per_layer: Mapping[int, int] | int | None = None,
) -> tuple[int, ...]:
    """Sorted layer ids maximising removed mismatch per byte within ``config.budget_bytes_per_token``.

    ``bytes_per_layer``: guidance bytes per token of each layer (``accounting.bytes_per_layer``)
    or one int for all layers.
    """
    budget = float(config.budget_bytes_per_token)
    if budget <= 0:
        raise ValueError(f"budget_bytes_per_token={budget} must be > 0 for the budget policy")
    profile = _per_layer(mismatch_profile, num_layers, "mismatch_profile", float)
    if bytes_per_layer is None:
        raise ValueError("the budget layer policy needs bytes_per_layer (see accounting.bytes_per_layer)")
    cost = _per_layer(bytes_per_layer, num_layers, "bytes_per_layer", int)
    order = sorted(
        (i for i in range(num_layers) if profile[i] > 0),
        key=lambda i: (-(profile[i] / cost[i]) if cost[i] else -math.inf, -i),
    )
    chosen, used = [], 0
    for i in order:
        if used + cost[i] <= budget:
            chosen.append(i)
            used += cost[i]
    logger.info("budget policy: %d layers, %d of %.0f bytes/token", len(chosen), used, budget)
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class RLSettings:
    """One RL step as the planner sees it."""

    trajectories: int = 4096
    prompt_len: int = 1024
    response_len: int = 8192
    bandwidth_gbps: float = 400.0  # gigabits per second of the rollout -> trainer link
    steps_in_flight: int = 1  # rollout steps held on the host at once (async RL: staleness + 1)

    def __post_init__(self):
        for f in ("trajectories", "response_len", "steps_in_flight"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 1")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len={self.prompt_len} must be >= 0")
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps={self.bandwidth_gbps} must be > 0")

    @property
    def tokens_per_step(self) -> int:
        return self.trajectories * (self.prompt_len + self.response_len)


def plan_row(dims: ModelDims, config: TraceConfig, rl: RLSettings, policy: str, **budget_kw) -> dict:
    """Sizes of one (layer policy, cache mode) choice: bytes/token, bytes/step, host bytes, sync seconds."""
    if config.guided_layers == "budget" and "bytes_per_layer" not in budget_kw:
        budget_kw["bytes_per_layer"] = bytes_per_layer(dims, config.guided_sites, **config_fmt_kw(config))
    layers = guided_layers(config, dims.num_layers, **budget_kw)
    bpt = bytes_per_token(dims, config.guided_sites, layers, **config_fmt_kw(config))
    per_step = bpt * rl.tokens_per_step
    return {
        "policy": policy,
        "mode": config.cache_mode,
        "format": config.format,
        "num_layers": len(layers),
        "layers": list(layers),
        "bytes_per_token": bpt,
        "bytes_per_step": per_step,
        "host_bytes": per_step * rl.steps_in_flight,
        "sync_seconds": per_step * 8 / (rl.bandwidth_gbps * 1e9),
    }
