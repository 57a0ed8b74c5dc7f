"""Alarms on the train-rollout mismatch: a CI gate, a trend alarm, topology tags, phases, sentinels.

* ``check_mismatch_gate``: ``max_abs_diff`` (the demo's ``rl.max_logprob_abs_diff``; slime's CI check; off by
  default) raises ``MismatchGateError`` when ``mismatch/logprob_abs_diff`` exceeds the bound.
* ``TrendAlarm``: a rising mismatch is a framework bug even when each value looks small (NeMo-RL#1801).
  Relative mode (default): the window's growth, robust slope x span / median level, above ``max_growth``
  (one threshold for any model or metric, whatever its level); absolute mode: the least-squares slope
  per step above ``max_slope`` (in the metric's units). A NaN/Inf value fires at once.
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
import numbers
import statistics
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


def _is_number(v) -> bool:
    """A real number: a Python or NumPy int or float, not a bool (``True >= 0``: taken as 1)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def check_mismatch_gate(metrics: dict[str, float], max_abs_diff: float | None, *, key: str = ABS_DIFF) -> None:
    """Raise ``MismatchGateError`` if ``metrics[key] > max_abs_diff`` (``None``: the gate is off)."""
    if max_abs_diff is None:
        return
    if not isinstance(max_abs_diff, int | float) or isinstance(max_abs_diff, bool) or not max_abs_diff >= 0:  # NaN
        raise ValueError(f"max_abs_diff={max_abs_diff!r} must be a number >= 0 or None (off)")
    if key not in metrics:
        raise KeyError(f"the mismatch gate needs {key!r}; got {sorted(metrics)[:6]}...")
    v = float(metrics[key])
    if not v <= max_abs_diff:  # NaN fails the gate too
        raise MismatchGateError(f"{key}={v:.6g} exceeds max_logprob_abs_diff={max_abs_diff} (train and rollout "
                                "compute different log-probs: check the recipe, weight sync and guidance coverage)")


def _steps_of(values: Sequence[float], steps: Sequence[float] | None) -> list[float]:
    """``steps`` as floats (default 0..n-1); ``ValueError`` unless there is one per value (zip would drop the rest
    and the mean of the shorter list would skew the slope)."""
    if steps is None:
        return [float(i) for i in range(len(values))]
    xs = [float(s) for s in steps]
    if len(xs) != len(values):
        raise ValueError(f"{len(xs)} steps for {len(values)} values: give one step per value (or steps=None)")
    return xs


def least_squares_slope(values: Sequence[float], steps: Sequence[float] | None = None) -> float:
    """Slope of the least-squares line through ``(steps, values)`` (steps default 0..n-1)."""
    n = len(values)
    xs = _steps_of(values, steps)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx if sxx else 0.0


def theil_sen_slope(values: Sequence[float], steps: Sequence[float] | None = None) -> float:
    """Median of the pairwise slopes ``(v_j - v_i) / (s_j - s_i)`` (Theil-Sen; steps default 0..n-1).

    A single spike moves it little (it shifts n - 1 of the n (n - 1) / 2 slopes), unlike the least-squares
    slope; pairs at the same step are skipped. O(n^2): meant for windows of up to a few hundred steps."""
    xs = _steps_of(values, steps)
    slopes = [(values[j] - values[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    return statistics.median(slopes) if slopes else 0.0


TREND_MODES = ("relative", "absolute")


def check_trend_settings(*, mode: str | None, max_slope: float | None, max_growth: float | None,
                         min_level: float, prefix: str = "") -> str:
    """The trend alarm's mode (``None``: absolute if ``max_slope`` is given, as before session 41, else
    relative); raises ``ValueError`` naming a bad or conflicting setting (``prefix`` + its name)."""
    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    if mode is None:
        mode = "absolute" if max_slope is not None else "relative"
    if mode not in TREND_MODES:
        raise ValueError(f"{prefix}mode={mode!r} must be one of {TREND_MODES} (or None: absolute when "
                         f"{prefix}max_slope is set, else relative)")
    if not number(min_level) or min_level <= 0:
        raise ValueError(f"{prefix}min_level={min_level!r} must be a finite number > 0 (the level below which a "
                         "window's median counts as this floor in the relative growth)")
    if mode == "absolute":
        if max_growth is not None:
            raise ValueError(f"{prefix}max_growth={max_growth!r} is the relative mode's threshold: drop it, or set "
                             f"{prefix}mode='relative' and drop {prefix}max_slope")
        if not number(max_slope):
            raise ValueError(f"{prefix}max_slope={max_slope!r} must be a finite number in {prefix}mode='absolute' "
                             "(the metric's rise per step that fires the alarm; NaN: the alarm never fires)")
    else:
        if max_slope is not None:
            raise ValueError(f"{prefix}max_slope={max_slope!r} is the absolute mode's threshold: set "
                             f"{prefix}mode='absolute' to use it, or drop it (relative mode fires on "
                             f"{prefix}max_growth)")
        if max_growth is not None and (not number(max_growth) or max_growth < 0):
            raise ValueError(f"{prefix}max_growth={max_growth!r} must be a finite number >= 0 (the window's rise as "
                             "a fraction of its median level, e.g. 1.0: by the whole level) or None (1.0)")
    return mode


class TrendAlarm:
    """Fires when ``key`` rises over the last ``window`` steps (checked once the window is full).

    * ``mode="relative"`` (the default): the window's growth, the Theil-Sen slope (``theil_sen_slope``) times
      the window's span of steps, divided by the window's median level, above ``max_growth`` (default 1.0):
      the trend line rises across the window by more than the metric's own level (e.g. a line from 0.5x to
      1.5x the median: 3x from the window's start to its end). Level-free, so one threshold holds for a BF16
      floor of 1e-3 and an FP4 run 13x above it; a robust slope and level, so one spike is not a trend (a
      spike or a high level is the CI gate's job).
      Guard: a median below ``min_level`` (default 1e-6, about ten float32 roundings of a log-prob of order
      one) counts as ``min_level``, so a window at or near zero (a bit-exact rollout) has a growth near 0,
      not 0 / 0; a rise from zero to a real mismatch still fires.
    * ``mode="absolute"``: the least-squares slope per step above ``max_slope`` (the metric's units per step;
      the only mode before session 41: ``mode=None`` with ``max_slope`` given picks it).

    A NaN/Inf value fires at once in either mode and stays out of the window. ``update(metrics, step)``
    returns ``{f"{key}/slope": least-squares slope per step, f"{key}/growth": relative growth,
    f"alarm/{key with / as _}_rising": 0|1}`` (both numbers in either mode), logs a warning when it fires
    and raises ``MismatchGateError`` instead if ``raise_on_alarm``.
    """

    def __init__(self, *, window: int = 20, mode: str | None = None, max_growth: float | None = None,
                 max_slope: float | None = None, min_level: float = 1e-6, key: str = ABS_DIFF,
                 raise_on_alarm: bool = False):
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window={window!r} must be an int >= 2")
        if not isinstance(raise_on_alarm, bool):  # (a config's "no" is truthy: the alarm raised, stopping the run)
            raise ValueError(f"raise_on_alarm={raise_on_alarm!r} must be a bool")
        if not isinstance(key, str):
            raise ValueError(f"key={key!r} must be a metric name (a str, e.g. {ABS_DIFF!r})")
        self.mode = check_trend_settings(mode=mode, max_slope=max_slope, max_growth=max_growth, min_level=min_level)
        self.max_growth = None if self.mode == "absolute" else float(1.0 if max_growth is None else max_growth)
        self.max_slope = None if max_slope is None else float(max_slope)
        self.window, self.min_level, self.key, self.raise_on_alarm = window, float(min_level), key, raise_on_alarm
        self._steps: deque[float] = deque(maxlen=window)
        self._values: deque[float] = deque(maxlen=window)
        self._count = 0

    def growth(self) -> float:
        """The window's Theil-Sen rise across its steps over its median level (``min_level`` at least)."""
        if len(self._values) < 2:
            return 0.0
        level = max(abs(statistics.median(self._values)), self.min_level)
        return theil_sen_slope(list(self._values), list(self._steps)) * (self._steps[-1] - self._steps[0]) / level

    def update(self, metrics: dict[str, float], step: int | None = None) -> dict[str, float]:
        if self.key not in metrics:  # (checked before the step counts)
            raise KeyError(f"the trend alarm watches {self.key!r}, which this step's metrics lack (they have "
                           f"{sorted(metrics)[:6]}{'...' if len(metrics) > 6 else ''})")
        if step is not None and not (_is_number(step) and math.isfinite(step)):  # ("3", True were taken as steps)
            raise ValueError(f"step={step!r} must be a finite number (the RL step) or None (the update count)")
        try:  # (read before the update counts: a refused one moved the next update's x by one, halving its slope)
            value = float(metrics[self.key])
        except (TypeError, ValueError):
            raise ValueError(f"the trend alarm's metric {self.key!r} is {metrics[self.key]!r}, not a number; this "
                             "update is not counted") from None
        at = float(self._count if step is None else step)
        self._count += 1
        if math.isfinite(value):  # a NaN/Inf fires at once and stays out of the window (its slope would be NaN)
            self._steps.append(at)
            self._values.append(value)
        full = len(self._values) == self.window
        slope, growth = least_squares_slope(list(self._values), list(self._steps)), self.growth()
        rising = growth > self.max_growth if self.mode == "relative" else slope > self.max_slope
        fired = not math.isfinite(value) or (full and rising)
        if fired:
            span = (f"over the last {self.window} steps: from {self._values[0]:.4g} to {self._values[-1]:.4g}"
                    if self._values else "")
            if not math.isfinite(value):
                msg = f"{self.key} is {value} at step {at:g}"
            elif self.mode == "relative":
                msg = (f"{self.key} grows by {growth:.0%} of its level {span} (alarm above {self.max_growth:.0%}; "
                       f"robust slope x steps / median)")
            else:
                msg = f"{self.key} rises by {slope:.3g}/step {span} (alarm above {self.max_slope:.3g}/step)"
            if self.raise_on_alarm:
                raise MismatchGateError(msg)
            logger.warning(msg)
        return {f"{self.key}/slope": slope, f"{self.key}/growth": growth,
                f"alarm/{self.key.replace('/', '_')}_rising": float(fired)}

    def state_dict(self) -> dict:
        """The window and step count (a checkpoint's part: a resumed run keeps watching the same trend)."""
        return {"steps": list(self._steps), "values": list(self._values), "count": self._count}

    def load_state_dict(self, state: dict) -> None:
        if len(state["steps"]) != len(state["values"]) or len(state["values"]) > self.window:
            raise ValueError(f"a trend window of {len(state['values'])} values does not fit window={self.window}")
        # all read before any is set: a state that fails half-way (a value that is not a number, no "count") left the
        # new steps beside the old values
        steps = deque((float(v) for v in state["steps"]), maxlen=self.window)
        values = deque((float(v) for v in state["values"]), maxlen=self.window)
        count = int(state["count"])
        self._steps, self._values, self._count = steps, values, count


TOPOLOGY_KEYS = ("tp", "ep", "dp", "pp", "cp")


def topology_prefix(*, tp: int = 1, ep: int = 1, dp: int = 1, pp: int = 1, cp: int = 1) -> str:
    """``"tp2_ep4_dp1_pp1"`` (``_cp{n}`` appended when context parallel > 1)."""
    for name, v in zip(TOPOLOGY_KEYS, (tp, ep, dp, pp, cp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    tag = f"tp{tp}_ep{ep}_dp{dp}_pp{pp}"
    return tag + (f"_cp{cp}" if cp > 1 else "")


def tag_topology(metrics: dict[str, float], topology: dict[str, int]) -> dict[str, float]:
    """Every key prefixed with the topology (``tp1_ep2_dp1_pp1/mismatch/...``) plus ``topology/*`` values."""
    unknown = sorted(set(topology) - set(TOPOLOGY_KEYS))
    if unknown:  # (a bare TypeError of topology_prefix's keywords, not naming the valid ones)
        raise ValueError(f"topology keys {unknown} are not among {TOPOLOGY_KEYS} (expert TP is not tagged)")
    tag = topology_prefix(**topology)
    out = {f"{tag}/{k}": v for k, v in metrics.items()}
    out.update({f"topology/{k}": float(v) for k, v in topology.items()})
    return out


def first_response_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: the first response token of each sequence (sampled from the prefill's logits)."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be bool [B, S], got shape {tuple(mask.shape)}")
    if mask.shape[1] == 0:  # no positions (argmax has no empty reduction)
        return mask.bool()
    first = mask.long().argmax(1, keepdim=True)  # [B, 1]
    return torch.zeros_like(mask).scatter(1, first, True) & mask


def phase_metrics(lt: torch.Tensor, lr: torch.Tensor, mask: torch.Tensor, prefill_mask: torch.Tensor | None = None,
                  prefix: str = "mismatch") -> dict[str, float]:
    """abs(d) token mean / max and token count over prefill and decode positions separately.

    ``prefill_mask`` (bool [B, S]): response tokens whose rollout log-prob came from a prefill forward
    (default: the first response token); the other response tokens are decode positions. A phase without tokens
    (``tokens`` 0: e.g. every response ended at its first token) has NaN mean and max: no value, not a zero mismatch.
    """
    for name, m in (("mask", mask), ("prefill_mask", prefill_mask)):  # (an integer mask would index, not select)
        if m is not None and (m.dtype != torch.bool or m.shape != lt.shape or lr.shape != lt.shape):
            raise ValueError(f"{name} must be bool of the log-probs' shape [B, S] {tuple(lt.shape)} (rollout "
                             f"{tuple(lr.shape)}), got {m.dtype} {tuple(m.shape)}")
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
    if not isinstance(kv_quantized, bool):  # ("no" is truthy: the split was added to a BF16 KV cache's metrics)
        raise ValueError(f"kv_quantized={kv_quantized!r} must be a bool")
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
        from .rollout.base import SamplingParams, is_int

        # (int(t) took 3.9 as token 3, True as 1 and the string "12" as the tokens 1, 2: another prompt, silently)
        raw = self.prompts.tolist() if hasattr(self.prompts, "tolist") else self.prompts  # (a 2-D tensor or array)
        prompts = [p.tolist() if hasattr(p, "tolist") else p for p in raw] if isinstance(raw, Sequence) else []
        if isinstance(raw, str | bytes) or not prompts or any(
                isinstance(p, str | bytes) or not isinstance(p, Sequence) or not p for p in prompts):
            raise ValueError(f"SentinelCheck.prompts={self.prompts!r:.80} must be a non-empty list of non-empty "
                             "token-id lists")
        bad = [t for p in prompts for t in p if not is_int(t) or t < 0]
        if bad:
            raise ValueError(f"SentinelCheck.prompts holds {bad[0]!r} ({type(bad[0]).__name__}): token ids are ints "
                             ">= 0")
        object.__setattr__(self, "prompts", tuple(tuple(int(t) for t in p) for p in prompts))
        d = self.max_abs_diff
        if d is not None and not (_is_number(d) and d >= 0):  # (True was a bound of 1; "0.5" a bare TypeError)
            raise ValueError(f"SentinelCheck.max_abs_diff={d!r} must be a number >= 0 or None")
        if not isinstance(self.prefix, str):
            raise ValueError(f"SentinelCheck.prefix={self.prefix!r} must be a str (its metrics' key prefix)")
        # (checked now, not at the first sync's run: max_new_tokens=0 or 2.5 was taken until then)
        try:
            SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"SentinelCheck.max_new_tokens={self.max_new_tokens!r}: {e}") from e

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
