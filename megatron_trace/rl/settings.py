"""The GRPO driver's settings (``RLConfig``: Hydra's ``rl`` group), checked when built."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass

from ..monitor import check_trend_settings
from ..rollout.base import COMPILE_CHOICES, MIN_TEMPERATURE, STATIC_DECODE, is_compile_choice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    steps: int = 20
    prompts_per_step: int = 16
    group_size: int = 8
    micro_batch_size: int = 0  # trainer rows per micro-batch of Megatron's schedule (0: the step's whole batch)
    lr: float = 5e-5
    clip_eps: float = 0.2
    tis_cap: float | None = 5.0
    kl_coef: float = 0.0
    temperature: float = 1.0
    routing_replay: bool = True  # R3 in every arm (off when this or TraceConfig.routing_replay is off)
    weight_sync: str = "auto"  # auto (fp4 for FP4 rollouts with the "weights" site) | bf16 | fp4
    eval_problems: int = 500
    quant_metrics_every: int = 1
    checkpoint_every: int = 0
    seed: int = 0
    max_logprob_abs_diff: float | None = None  # CI gate (slime's check): raise above it; None = off
    trend_window: int = 10  # mismatch trend alarm over this many steps (monitor.TrendAlarm) -> warning
    trend_mode: str | None = None  # relative | absolute (None: absolute if trend_max_slope is set, else relative)
    trend_max_growth: float | None = None  # relative: the window's rise over its median level (None: 1.0)
    trend_max_slope: float | None = None  # absolute: logprob_abs_diff's rise per step (before session 41: 0.01)
    trend_min_level: float = 1e-6  # relative: a window median below this counts as this (a zero level's guard)
    sentinel_prompts: int = 4  # after every weight sync, compare this many fixed prompts' log-probs (0 = off)
    sentinel_max_abs_diff: float | None = None  # raise above it (None: log only)
    fast_kv_attention: bool = True  # hf rollout: the fast FP4-KV decode attention (exact FP4 K/V values)
    compile_rollout: bool | str = False  # hf rollout's compile: false | true/modules | layers (rollout.compiled)
    static_decode: str = "auto"  # hf rollout's decode loop: auto (CUDA graphs on CUDA) | off | eager | graph

    def __post_init__(self):
        def need(ok: bool, name: str, want: str):
            if not ok:
                raise ValueError(f"RLConfig.{name}={getattr(self, name)!r} must be {want}")

        for name in ("steps", "prompts_per_step", "group_size", "eval_problems", "trend_window"):
            v, least = getattr(self, name), 2 if name in ("group_size", "trend_window") else 1
            need(isinstance(v, int) and not isinstance(v, bool) and v >= least, name, f"an int >= {least}" + (
                 " (a group of one response has advantage 0: nothing to learn)" if name == "group_size" else ""))
        for name in ("quant_metrics_every", "checkpoint_every", "sentinel_prompts", "seed"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, name, "an int >= 0 (0: off)")
        for name in ("lr", "clip_eps", "tis_cap", "kl_coef", "temperature", "max_logprob_abs_diff",
                     "sentinel_max_abs_diff"):  # a YAML true is no 1.0 (tis_cap=true: the IS ratio capped at 1)
            v, off = getattr(self, name), name in ("tis_cap", "max_logprob_abs_diff", "sentinel_max_abs_diff")
            need((v is None and off) or (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)),
                 name, "a finite number" + (" or None (off)" if off else ""))
        need(self.lr > 0, "lr", "> 0")
        rows, mbs = self.prompts_per_step * self.group_size, self.micro_batch_size
        need(isinstance(mbs, int) and not isinstance(mbs, bool) and (mbs == 0 or (mbs > 0 and rows % mbs == 0)),
             "micro_batch_size", f"0 (the whole batch in one micro-batch) or a divisor of prompts_per_step * "
             f"group_size = {rows}")
        need(self.clip_eps > 0, "clip_eps", "> 0")
        need(self.tis_cap is None or self.tis_cap > 0, "tis_cap", "None (off) or > 0")
        need(self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf"), "temperature",
             f"0 (greedy) or >= {MIN_TEMPERATURE}")
        if self.temperature == 0:
            logger.warning("RLConfig.temperature=0: greedy rollouts give every response of a group the same tokens, "
                           "so every advantage is 0 and the policy does not learn (use it for evaluation or tests)")
        check_trend_settings(mode=self.trend_mode, max_slope=self.trend_max_slope, max_growth=self.trend_max_growth,
                             min_level=self.trend_min_level, prefix="RLConfig.trend_")
        need(self.weight_sync in WEIGHT_SYNCS, "weight_sync", f"one of {WEIGHT_SYNCS}")
        for name in ("routing_replay", "fast_kv_attention"):  # (a Hydra override 'off' is the string 'off': truthy)
            need(isinstance(getattr(self, name), bool), name, "a bool (true / false)")
        need(is_compile_choice(self.compile_rollout), "compile_rollout", f"one of {COMPILE_CHOICES}")
        need(isinstance(self.static_decode, str) and self.static_decode in STATIC_DECODE, "static_decode",
             f"one of {STATIC_DECODE}")
        for name in ("max_logprob_abs_diff", "sentinel_max_abs_diff"):
            need(getattr(self, name) is None or getattr(self, name) >= 0, name, "None (off) or >= 0")
        need(self.kl_coef == 0, "kl_coef", "0: this driver keeps no reference policy (the paper's GRPO + "
             "truncated IS has no KL term)")


WEIGHT_SYNCS = ("auto", "bf16", "fp4")
