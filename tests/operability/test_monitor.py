"""Issue 11 item 5: the max-abs-diff gate (off by default), the rising-mismatch alarm, the first token and the
prefill/decode split reported separately, metrics tagged with the parallel topology."""

import logging
import math

import pytest
import torch

from megatron_trace.monitor import (
    MismatchGateError,
    TrendAlarm,
    check_mismatch_gate,
    first_response_mask,
    least_squares_slope,
    phase_metrics,
    step_mismatch_metrics,
    topology_prefix,
)

# two sequences: prompts of 1 and 2 tokens, then 3 and 2 response tokens
MASK = torch.tensor([[False, True, True, True], [False, False, True, True]])
LR = torch.full((2, 4), -1.0)


def _lt(first: float, rest: float) -> torch.Tensor:
    """Trainer log-probs whose |d| is ``first`` on each first response token and ``rest`` elsewhere."""
    d = torch.where(first_response_mask(MASK), first, rest)
    return torch.where(MASK, LR + d, LR)


def test_gate_is_off_by_default_and_fires_above_the_bound():
    m = step_mismatch_metrics(_lt(0.5, 0.5), LR, MASK, kv_quantized=False)
    check_mismatch_gate(m, None)  # default: off
    check_mismatch_gate(m, 0.5)
    with pytest.raises(MismatchGateError, match=r"logprob_abs_diff=0.5 exceeds max_logprob_abs_diff=0.1"):
        check_mismatch_gate(m, 0.1)
    with pytest.raises(MismatchGateError):
        check_mismatch_gate({"mismatch/logprob_abs_diff": math.nan}, 0.1)
    with pytest.raises(ValueError, match="max_abs_diff=-1"):
        check_mismatch_gate(m, -1)


def test_slope_is_the_least_squares_fit():
    assert least_squares_slope([1.0, 3.0, 5.0]) == pytest.approx(2.0)
    assert least_squares_slope([0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.2)  # sum((x-mx)(y-my)) / sum((x-mx)^2) = 1/5
    assert least_squares_slope([2.0, 4.0], steps=[10, 20]) == pytest.approx(0.2)


def test_trend_alarm_fires_on_a_rising_mismatch_only(caplog):
    noisy_flat = [0.02 + 0.004 * (-1) ** i for i in range(30)]
    rising = [0.02 + 0.002 * i + 0.004 * (-1) ** i for i in range(30)]
    flat = TrendAlarm(window=10, max_slope=1e-3)
    assert not any(flat.update({"mismatch/logprob_abs_diff": v})["alarm/mismatch_logprob_abs_diff_rising"]
                   for v in noisy_flat)
    alarm = TrendAlarm(window=10, max_slope=1e-3)
    with caplog.at_level(logging.WARNING, logger="megatron_trace.monitor"):
        fired = [alarm.update({"mismatch/logprob_abs_diff": v}, step=i) for i, v in enumerate(rising)]
    flags = [f["alarm/mismatch_logprob_abs_diff_rising"] for f in fired]
    assert flags[:9] == [0.0] * 9 and flags[-1] == 1.0  # needs a full window, then fires
    assert fired[-1]["mismatch/logprob_abs_diff/slope"] == pytest.approx(0.002, rel=0.2)
    assert "rises by" in caplog.text
    strict = TrendAlarm(window=3, max_slope=0.0, raise_on_alarm=True)
    strict.update({"mismatch/logprob_abs_diff": 0.1})
    strict.update({"mismatch/logprob_abs_diff": 0.2})
    with pytest.raises(MismatchGateError, match="rises by"):
        strict.update({"mismatch/logprob_abs_diff": 0.3})


def test_trend_alarm_fires_on_a_non_finite_value_and_keeps_watching():
    key, flag = "mismatch/logprob_abs_diff", "alarm/mismatch_logprob_abs_diff_rising"
    alarm = TrendAlarm(window=4, max_slope=0.01)
    values = [0.5, 0.9, float("nan"), 1.3, 1.7, 2.1]  # rising 0.4/step around a NaN
    flags = [alarm.update({key: v}, step=i)[flag] for i, v in enumerate(values)]
    assert flags == [0.0, 0.0, 1.0, 0.0, 1.0, 1.0]  # the NaN at once; the rise once the window is full again
    copy = TrendAlarm(window=4, max_slope=0.01)
    copy.load_state_dict(alarm.state_dict())  # a checkpoint's window: the next value gives the same verdict
    assert copy.update({key: 2.5}, step=6) == alarm.update({key: 2.5}, step=6)
    with pytest.raises(ValueError, match="does not fit window=2"):
        TrendAlarm(window=2).load_state_dict(alarm.state_dict())


def test_first_token_and_prefill_decode_are_reported_separately():
    m = step_mismatch_metrics(_lt(0.8, 0.1), LR, MASK, kv_quantized=True)
    assert m["mismatch/first_token_abs_diff"] == pytest.approx(0.8)
    assert m["mismatch/prefill/logprob_abs_diff_token_mean"] == pytest.approx(0.8)
    assert m["mismatch/decode/logprob_abs_diff_token_mean"] == pytest.approx(0.1)
    assert (m["mismatch/prefill/tokens"], m["mismatch/decode/tokens"]) == (2.0, 3.0)
    assert "mismatch/prefill/tokens" not in step_mismatch_metrics(_lt(0.8, 0.1), LR, MASK, kv_quantized=False)
    custom = torch.zeros_like(MASK)
    custom[0, 3] = True  # e.g. a token after a tool response, prefilled again
    p = phase_metrics(_lt(0.8, 0.1), LR, MASK, prefill_mask=custom)
    assert p["mismatch/prefill/tokens"] == 1.0
    assert p["mismatch/prefill/logprob_abs_diff_token_max"] == pytest.approx(0.1)


def test_metrics_are_tagged_with_the_topology():
    m = step_mismatch_metrics(_lt(0.2, 0.2), LR, MASK, kv_quantized=False, topology=dict(tp=2, ep=4, dp=1, pp=1))
    assert m["tp2_ep4_dp1_pp1/mismatch/logprob_abs_diff"] == pytest.approx(0.2)
    assert m["topology/ep"] == 4.0 and not any(k.startswith("mismatch/") for k in m)
    assert topology_prefix(tp=1, ep=1, dp=2, pp=1, cp=2) == "tp1_ep1_dp2_pp1_cp2"
    with pytest.raises(ValueError, match="ep=0"):
        topology_prefix(ep=0)
