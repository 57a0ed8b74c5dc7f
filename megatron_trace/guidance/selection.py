"""Which layers get guidance: the layer policy of a TraceConfig resolved for a model depth.

Layers are numbered from 0. Policies: none, all, last_k, fraction (the deepest
``ceil(fraction * num_layers)`` layers; the paper's default is the deepest half), explicit,
budget (see ``budget_layers``).
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

from ..config import TraceConfig


def check_num_layers(num_layers) -> None:
    """An int >= 1 (2.5 and "4" were bare TypeErrors, True one layer)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} must be an int >= 1")


def guided_layers(config: TraceConfig, num_layers: int, **budget_kw) -> tuple[int, ...]:
    """The sorted layer ids that get guidance for a model of ``num_layers`` layers.

    ``budget_kw`` is passed to the budget policy (per-layer mismatch profile and bytes).
    """
    check_num_layers(num_layers)
    if not config.enabled:
        return ()
    policy = config.guided_layers
    if policy == "none":
        return ()
    if policy == "all":
        return tuple(range(num_layers))
    if policy == "last_k":
        if config.guided_last_k > num_layers:
            raise ValueError(f"guided_last_k={config.guided_last_k} exceeds num_layers={num_layers}")
        return tuple(range(num_layers - config.guided_last_k, num_layers))
    if policy == "fraction":
        k = math.ceil(Fraction(repr(config.guided_fraction)) * num_layers)  # as written: 0.28 * 25 is 7, not 8
        return tuple(range(num_layers - k, num_layers))
    if policy == "explicit":
        bad = [i for i in config.guided_layer_list if i >= num_layers]
        if bad:
            raise ValueError(
                f"guided_layer_list has layer(s) {bad} beyond num_layers={num_layers} (valid 0..{num_layers - 1})"
            )
        return tuple(sorted(set(config.guided_layer_list)))
    if policy == "budget":
        from .planner import budget_layers  # written with the guidance cache

        return budget_layers(config, num_layers, **budget_kw)
    raise AssertionError(policy)  # unreachable: TraceConfig validates the policy
