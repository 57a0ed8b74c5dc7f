"""A GRPO step that raises after its optimizer step: the step counts, so its retry serves its weights first and never
trains the same prompts twice (the driver's other failure paths: tests/rl/test_driver.py)."""

import pytest

from megatron_trace.config import TraceConfig
from megatron_trace.monitor import MismatchGateError, TrendAlarm
from megatron_trace.rl.arms import make_arm
from megatron_trace.rl.driver import GRPORun, RLConfig
from megatron_trace.rl.tasks import get_task

from . import test_driver

megatron_cpu, ckpt = test_driver.megatron_cpu, test_driver.ckpt  # (its fixtures: Megatron on CPU, the SFT model)


def test_a_step_whose_metrics_raise_after_the_optimizer_step_counts_and_is_not_trained_again(megatron_cpu, ckpt,
                                                                                              tmp_path):
    """The step counter moved after the step's metrics: a trend alarm raising (``raise_on_alarm``; or an interrupt)
    there left step 1's update in the weights but the step uncounted (state step 1, version 1, its records held in the
    cache), so the next step() trained step 1's prompts again on the stepped weights."""
    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig()), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    # fires once its window of 2 steps is full (a constant metric's slope 0 is above -1): at step 1
    r.trend = TrendAlarm(window=2, mode="absolute", max_slope=-1.0, key="trainer/micro_batches", raise_on_alarm=True)
    r.step()
    with pytest.raises(MismatchGateError, match="trainer/micro_batches rises"):
        r.step()
    assert (r.state.step, r.state.version, r.rollout.policy_version, r.cache.steps) == (2, 2, 1, [])
    r.trend = TrendAlarm(window=2)
    m = r.step()  # the sync to version 2 first, then step 2's prompts on version 2's weights
    assert m["guidance/assembly/coverage"] == 1.0 and m.get("guidance/assembly/fallback/version", 0.0) == 0.0
    assert (r.state.step, r.state.version, r.rollout.policy_version) == (3, 3, 3)
