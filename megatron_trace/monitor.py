"""Alarms on the train-rollout mismatch: a CI gate, a trend alarm, topology tags, phases, sentinels.

* ``check_mismatch_gate``: ``max_abs_diff`` (the demo's ``rl.max_logprob_abs_diff``; slime's CI check; off by
  default) raises ``MismatchGateError`` when ``mismatch/logprob_abs_diff`` exceeds the bound.
* ``TrendAlarm``: least-squares slope of a metric over the last N steps; a rising mismatch is a
  framework bug even when each value looks small (NeMo-RL#1801). A NaN/Inf value fires at once.
* ``phase_metrics``: the mismatch of prefill positions (the first response token, sampled from the
  prompt's forward) and decode positions separately; with a quantized KV cache they can diverge
  (sglang#25790). ``step_mismatch_metrics`` is the one call per step (adds it when the KV cache
  is quantized) and tags everything with the parallel topology (``topology_prefix``).
* ``SentinelCheck``: after a weight sync, greedy-decode a few fixed prompts on the rollout and
  compare their log-probs with the trainer's (catches stale derived state after refit).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .metrics import mismatch_metrics

if TYPE_CHECKING:  # the rollout package imports transformers: only the sentinel needs it, at run time
    from .rollout.base import RolloutBackend, RolloutBatch

logger = logging.getLogger(__name__)

ABS_DIFF = "mismatch/logprob_abs_diff"


class MismatchGateError(RuntimeError):
    """The train-rollout mismatch exceeded the configured gate."""


class SentinelError(RuntimeError):
    """After a weight sync, the rollout's sentinel log-probs disagree with the trainer's.

    ``metrics``: the sentinel's numbers (``SentinelCheck.run``'s row), for the failing step's metrics row."""

    def __init__(self, message: str, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.metrics = dict(metrics or {})


def check_mismatch_gate(metrics: dict[str, float], max_abs_diff: float | None, *, key: str = ABS_DIFF) -> None:
    """Raise ``MismatchGateError`` if ``metrics[key] > max_abs_diff`` (``None``: the gate is off)."""
    if max_abs_diff is None:
        return
    if not isinstance(max_abs_diff, int | float) or isinstance(max_abs_diff, bool) or max_abs_diff < 0:
        raise ValueError(f"max_abs_diff={max_abs_diff!r} must be a number >= 0 or None (off)")
    if key not in metrics:
        raise KeyError(f"the mismatch gate needs {key!r}; got {sorted(metrics)[:6]}...")
    v = float(metrics[key])
    if not v <= max_abs_diff:  # NaN fails the gate too
        raise MismatchGateError(f"{key}={v:.6g} exceeds max_logprob_abs_diff={max_abs_diff} (train and rollout "
                                "compute different log-probs: check the recipe, weight sync and guidance coverage)")


def least_squares_slope(values: Sequence[float], steps: Sequence[float] | None = None) -> float:
    """Slope of the least-squares line through ``(steps, values)`` (steps default 0..n-1)."""
    n = len(values)
    if n < 2:
        return 0.0
    xs = list(range(n)) if steps is None else [float(s) for s in steps]
    mx, my = sum(xs) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx if sxx else 0.0


class TrendAlarm:
    """Fires when the slope of ``key`` over the last ``window`` steps exceeds ``max_slope`` (per step).

    ``update(metrics, step)`` returns ``{f"{key}/slope": s, f"alarm/{key}_rising": 0|1}``, logs a warning
    when it fires and raises ``MismatchGateError`` instead if ``raise_on_alarm``.
    """

    def __init__(self, *, window: int = 20, max_slope: float = 0.0, key: str = ABS_DIFF,
                 raise_on_alarm: bool = False):
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window={window!r} must be an int >= 2")
        if not math.isfinite(max_slope):
            raise ValueError(f"max_slope={max_slope!r} must be finite")
        self.window, self.max_slope, self.key, self.raise_on_alarm = window, float(max_slope), key, raise_on_alarm
        self._steps: deque[float] = deque(maxlen=window)
        self._values: deque[float] = deque(maxlen=window)
        self._count = 0

    def update(self, metrics: dict[str, float], step: int | None = None) -> dict[str, float]:
        at = float(self._count if step is None else step)
        self._count += 1
        value = float(metrics[self.key])
        if math.isfinite(value):  # a NaN/Inf fires at once and stays out of the window (its slope would be NaN)
            self._steps.append(at)
            self._values.append(value)
        full = len(self._values) == self.window
        slope = least_squares_slope(list(self._values), list(self._steps))
        fired = not math.isfinite(value) or (full and slope > self.max_slope)
        if fired:
            msg = (f"{self.key} is {value} at step {at:g}" if not math.isfinite(value) else
                   f"{self.key} rises by {slope:.3g}/step over the last {self.window} steps "
                   f"(alarm above {self.max_slope:.3g}/step): from {self._values[0]:.4g} to {self._values[-1]:.4g}")
            if self.raise_on_alarm:
                raise MismatchGateError(msg)
            logger.warning(msg)
        return {f"{self.key}/slope": slope, f"alarm/{self.key.replace('/', '_')}_rising": float(fired)}

    def state_dict(self) -> dict:
        """The window and step count (a checkpoint's part: a resumed run keeps watching the same trend)."""
        return {"steps": list(self._steps), "values": list(self._values), "count": self._count}

    def load_state_dict(self, state: dict) -> None:
        if len(state["steps"]) != len(state["values"]) or len(state["values"]) > self.window:
            raise ValueError(f"a trend window of {len(state['values'])} values does not fit window={self.window}")
        self._steps = deque((float(v) for v in state["steps"]), maxlen=self.window)
        self._values = deque((float(v) for v in state["values"]), maxlen=self.window)
        self._count = int(state["count"])


def topology_prefix(*, tp: int = 1, ep: int = 1, dp: int = 1, pp: int = 1, cp: int = 1) -> str:
    """``"tp2_ep4_dp1_pp1"`` (``_cp{n}`` appended when context parallel > 1)."""
    for name, v in (("tp", tp), ("ep", ep), ("dp", dp), ("pp", pp), ("cp", cp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    tag = f"tp{tp}_ep{ep}_dp{dp}_pp{pp}"
    return tag + (f"_cp{cp}" if cp > 1 else "")


def tag_topology(metrics: dict[str, float], topology: dict[str, int]) -> dict[str, float]:
    """Every key prefixed with the topology (``tp1_ep2_dp1_pp1/mismatch/...``) plus ``topology/*`` values."""
    tag = topology_prefix(**topology)
    out = {f"{tag}/{k}": v for k, v in metrics.items()}
    out.update({f"topology/{k}": float(v) for k, v in topology.items()})
    return out


def first_response_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: the first response token of each sequence (sampled from the prefill's logits)."""
    first = mask.long().argmax(1, keepdim=True)  # [B, 1]
    return torch.zeros_like(mask).scatter(1, first, True) & mask


def phase_metrics(lt: torch.Tensor, lr: torch.Tensor, mask: torch.Tensor, prefill_mask: torch.Tensor | None = None,
                  prefix: str = "mismatch") -> dict[str, float]:
    """abs(d) token mean / max and token count over prefill and decode positions separately.

    ``prefill_mask`` (bool [B, S]): response tokens whose rollout log-prob came from a prefill forward
    (default: the first response token); the other response tokens are decode positions.
    """
    if prefill_mask is None:
        prefill_mask = first_response_mask(mask)
    d = (lt.double() - lr.double()).abs()
    out = {}
    for phase, m in (("prefill", mask & prefill_mask), ("decode", mask & ~prefill_mask)):
        n = int(m.sum())
        out[f"{prefix}/{phase}/tokens"] = float(n)
        out[f"{prefix}/{phase}/logprob_abs_diff_token_mean"] = float(d[m].mean()) if n else float("nan")
        out[f"{prefix}/{phase}/logprob_abs_diff_token_max"] = float(d[m].max()) if n else float("nan")
    return out


def step_mismatch_metrics(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                          kv_quantized: bool, prefill_mask: torch.Tensor | None = None,
                          topology: dict[str, int] | None = None) -> dict[str, float]:
    """``mismatch_metrics`` (first token included) + the prefill/decode split when the KV cache is
    quantized, tagged with ``topology`` (``{"tp": .., "ep": .., "dp": .., "pp": ..}``) if given."""
    m = mismatch_metrics(trainer_logprobs, rollout_logprobs, mask)
    if kv_quantized:
        m.update(phase_metrics(trainer_logprobs, rollout_logprobs, mask, prefill_mask))
    return tag_topology(m, topology) if topology is not None else m


@dataclass(frozen=True)
class SentinelCheck:
    """Greedy-decode ``prompts`` for ``max_new_tokens`` on the rollout after a sync and compare the
    log-probs with ``trainer_logprobs(batch) -> [B, S]`` (the trainer's recompute of the batch).
    ``max_abs_diff``: raise ``SentinelError`` above it (None: log and return only)."""

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int = 4
    max_abs_diff: float | None = None
    prefix: str = "sentinel"

    def __post_init__(self):
        object.__setattr__(self, "prompts", tuple(tuple(int(t) for t in p) for p in self.prompts))
        if not self.prompts or any(not p for p in self.prompts):
            raise ValueError("SentinelCheck.prompts must be a non-empty list of non-empty token-id lists")
        if self.max_abs_diff is not None and not self.max_abs_diff >= 0:
            raise ValueError(f"SentinelCheck.max_abs_diff={self.max_abs_diff!r} must be >= 0 or None")

    def run(self, backend: RolloutBackend, trainer_logprobs: Callable[[RolloutBatch], torch.Tensor]) -> dict:
        from .rollout.base import SamplingParams

        batch = backend.generate([list(p) for p in self.prompts],
                                 SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens))
        lt = trainer_logprobs(batch).to(batch.logprobs.device, torch.float32)
        m = mismatch_metrics(lt, batch.logprobs, batch.response_mask, prefix=self.prefix)
        keep = ("logprob_abs_diff", "logprob_abs_diff_token_max", "first_token_abs_diff")
        out = {f"{self.prefix}/{k}": m[f"{self.prefix}/{k}"] for k in keep}
        out[f"{self.prefix}/policy_version"] = float(batch.policy_version)
        logger.info("sentinel after sync to version %d: %s", batch.policy_version,
                    {k: round(v, 6) for k, v in out.items()})
        v = out[f"{self.prefix}/logprob_abs_diff"]
        if self.max_abs_diff is not None and not v <= self.max_abs_diff:
            raise SentinelError(f"sentinel prompts after the sync to version {batch.policy_version}: "
                                f"logprob_abs_diff={v:.6g} > {self.max_abs_diff} (stale or half-applied weights, "
                                "stale derived scales, or a recipe mismatch)", metrics=out)
        return out
