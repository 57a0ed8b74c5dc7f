"""Issue 11 item 5: the max-abs-diff gate (off by default), the rising-mismatch alarm (relative by default since
session 41; absolute as before), the first token and the prefill/decode split reported separately, metrics tagged
with the parallel topology."""

import logging
import math

import pytest
import torch

from megatron_trace.monitor import (
    ABS_DIFF,
    MismatchGateError,
    SentinelCheck,
    TrendAlarm,
    check_mismatch_gate,
    first_response_mask,
    least_squares_slope,
    phase_metrics,
    step_mismatch_metrics,
    theil_sen_slope,
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
    for bad in (-1, math.nan):  # (a NaN bound failed every step as a MismatchGateError blaming the model)
        with pytest.raises(ValueError, match=f"max_abs_diff={bad} must be a number >= 0 or None"):
            check_mismatch_gate(m, bad)
    check_mismatch_gate(step_mismatch_metrics(LR, LR, MASK, kv_quantized=False), 0.0)  # a bit-exact gate
    with pytest.raises(MismatchGateError):
        check_mismatch_gate(m, 0.0)


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


KEY, FLAG = "mismatch/logprob_abs_diff", "alarm/mismatch_logprob_abs_diff_rising"
GROWTH = "mismatch/logprob_abs_diff/growth"

# Real mismatch/logprob_abs_diff of the CPU demo (examples/conf/demo.yaml, 30 RL steps; benchmarks/results/s40/
# demo_seeds), 4 significant digits. bf16 / trace / trace_full are healthy; per arm the seed with the largest
# 10-step growth, trace_full seed 1 ending on a 7x spike, trace seed 2 with a 3x spike at step 26.
DEMO = {
    "bf16_s0": [0.004138, 0.005033, 0.003238, 0.004908, 0.00535, 0.006552, 0.005451, 0.006804, 0.009412, 0.005588,
                0.005728, 0.00564, 0.00736, 0.005453, 0.004245, 0.005421, 0.005924, 0.006886, 0.00657, 0.008619,
                0.007445, 0.007795, 0.008175, 0.006198, 0.007958, 0.008865, 0.01073, 0.01099, 0.008765, 0.007504],
    "bf16_s2": [0.005287, 0.002909, 0.004469, 0.004954, 0.00455, 0.004357, 0.005652, 0.008932, 0.003325, 0.006135,
                0.006847, 0.007431, 0.006149, 0.009227, 0.009288, 0.01013, 0.009126, 0.006062, 0.006825, 0.007258,
                0.006522, 0.006586, 0.006143, 0.009309, 0.006561, 0.006668, 0.01305, 0.00654, 0.008414, 0.008648],
    "trace_s2": [0.006635, 0.006114, 0.008839, 0.01158, 0.009548, 0.009035, 0.006273, 0.01108, 0.01246, 0.009083,
                 0.007322, 0.006983, 0.007525, 0.01082, 0.009381, 0.01365, 0.01461, 0.01056, 0.008396, 0.006663,
                 0.009488, 0.01206, 0.01628, 0.006949, 0.01331, 0.01135, 0.03341, 0.01092, 0.01304, 0.01053],
    "trace_full_s0": [0.001882, 0.0009787, 0.001986, 0.002716, 0.002217, 0.001558, 0.0009395, 0.002298, 0.0008473,
                      0.002064, 0.002098, 0.002189, 0.003094, 0.003113, 0.001175, 0.002218, 0.002241, 0.0009358,
                      0.001311, 0.001977, 0.0017, 0.001213, 0.002609, 0.002362, 0.001168, 0.002504, 0.002673,
                      0.003232, 0.002175, 0.001929],
    "trace_full_s1": [0.002529, 0.0004976, 0.001672, 0.001511, 0.001411, 0.002429, 0.001483, 0.001396, 0.001408,
                      0.002087, 0.002001, 0.0018, 0.002418, 0.004179, 0.002549, 0.00228, 0.002925, 0.001845,
                      0.002547, 0.00243, 0.002153, 0.001918, 0.004007, 0.003312, 0.001694, 0.00256, 0.001496,
                      0.003802, 0.002345, 0.0161],
}
# fp4_naive seed 2: about 13x the BF16 floor, flat but for one 4x spike at step 26
FP4_NAIVE_S2 = [0.08472, 0.05583, 0.05526, 0.05701, 0.07769, 0.1223, 0.06915, 0.1102, 0.08018, 0.08959, 0.08565,
                0.07909, 0.07644, 0.1129, 0.1003, 0.1306, 0.1021, 0.1565, 0.09238, 0.1473, 0.08883, 0.08205, 0.09756,
                0.08975, 0.07977, 0.1772, 0.3764, 0.0965, 0.106, 0.1283]


def _watch(values, **kw) -> list[dict]:
    alarm = TrendAlarm(window=10, **kw)
    return [alarm.update({KEY: v}, step=i) for i, v in enumerate(values)]


def _fired(rows) -> list[int]:
    return [i for i, r in enumerate(rows) if r[FLAG]]


def test_theil_sen_slope_ignores_one_spike():
    assert theil_sen_slope([1.0, 3.0, 5.0]) == pytest.approx(2.0)
    assert theil_sen_slope([2.0, 4.0], steps=[10, 20]) == pytest.approx(0.2)
    spike = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 7.0]
    assert theil_sen_slope(spike) == 0.0 and least_squares_slope(spike) == pytest.approx(6 * 3 / 28)
    assert theil_sen_slope([1.0, 2.0, 5.0], steps=[3, 3, 4]) == pytest.approx(3.5)  # the same-step pair is skipped
    assert theil_sen_slope([4.0]) == 0.0


@pytest.mark.parametrize("slope", [least_squares_slope, theil_sen_slope], ids=["least_squares", "theil_sen"])
@pytest.mark.parametrize("values, steps", [([1.0, 2.0, 3.0], [0, 1]), ([1.0, 2.0], [0, 1, 2]), ([5.0], []),
                                           ([], [3])], ids=["fewer-steps", "more-steps", "one-value", "no-values"])
def test_slopes_refuse_steps_of_another_length(slope, values, steps):
    """zip kept the shorter list: [1, 2, 3] at steps [0, 1] gave a least-squares slope of 0.6 (the mean of 3 values
    against 2 steps), not an error."""
    with pytest.raises(ValueError, match=rf"{len(steps)} steps for {len(values)} values: give one step per value"):
        slope(values, steps)
    assert slope([1.0, 2.0, 3.0], [0, 1, 2]) == pytest.approx(1.0) and slope([], []) == 0.0


@pytest.mark.parametrize("name", sorted(DEMO))
def test_relative_alarm_is_silent_on_the_demos_healthy_arms(name, caplog):
    """Default settings (relative, growth 1.0, window 10): no healthy arm of the demo's three seeds comes near it
    (the largest growth of all 189 full windows is 0.83, trace_full seed 0), spikes included."""
    with caplog.at_level(logging.WARNING, logger="megatron_trace.monitor"):
        rows = _watch(DEMO[name])
    assert _fired(rows) == [] and caplog.text == ""
    assert max(r[GROWTH] for r in rows[9:]) < 0.85


def test_a_flat_but_high_fp4_run_is_the_gates_job_not_the_alarms():
    """fp4_naive does not rise within 30 steps, it sits 13x above the BF16 floor: the relative alarm stays silent;
    the absolute one (0.01/step) fired at steps 26-27 of the real run, on one spike (its least-squares slope)."""
    rows = _watch(FP4_NAIVE_S2)
    assert _fired(rows) == [] and max(r[GROWTH] for r in rows[9:]) < 0.7
    assert _fired(_watch(FP4_NAIVE_S2, mode="absolute", max_slope=0.01)) == [26, 27]
    with pytest.raises(MismatchGateError):  # the level is what the CI gate bounds
        check_mismatch_gate({KEY: FP4_NAIVE_S2[0]}, 0.05)


def test_relative_alarm_fires_on_a_collapse_at_any_level(caplog):
    """The real bf16 seed-0 noise times a collapse from step 10 on (doubling every 7 steps): the relative alarm
    fires at step 18 and on (not during the healthy part); at the demo's level the absolute 0.01/step never does,
    and 1000x higher it fires on the healthy steps already. The relative verdict does not depend on the level."""
    collapse = [v * 2 ** (max(0, t - 10) / 7) for t, v in enumerate(DEMO["bf16_s0"])]
    with caplog.at_level(logging.WARNING, logger="megatron_trace.monitor"):
        rows = _watch(collapse)
    assert _fired(rows) == list(range(18, 30))
    assert "grows by" in caplog.text and "of its level" in caplog.text
    for scale in (1e-3, 1e3):
        scaled = _watch([v * scale for v in collapse])
        assert _fired(scaled) == _fired(rows)
        assert [r[GROWTH] for r in scaled] == pytest.approx([r[GROWTH] for r in rows], rel=1e-9)
    assert _fired(_watch(collapse, mode="absolute", max_slope=0.01)) == []
    assert _fired(_watch([v * 1e3 for v in collapse], mode="absolute", max_slope=0.01))[0] == 9


def test_relative_growth_guards_a_zero_level_and_fires_on_non_finite():
    assert _fired(rows := _watch([0.0] * 12)) == [] and rows[-1][GROWTH] == 0.0  # 0 / 0 would be NaN
    tiny = _watch([1e-9 * t for t in range(12)])  # below min_level=1e-6: float noise, not a trend
    assert _fired(tiny) == [] and tiny[-1][GROWTH] == pytest.approx(9e-9 / 1e-6)
    assert _fired(_watch([0.0] * 5 + [2e-4 * t for t in range(1, 8)]))[0] == 9  # from zero to a real mismatch
    signed = _watch([-0.01 - 0.002 * t for t in range(10)])  # a falling negative level: |median|
    assert signed[-1][GROWTH] == pytest.approx(-0.018 / 0.019) and not _fired(signed)
    values = [0.01, 0.01, float("inf"), 0.01, float("nan")] + [0.01] * 8
    assert _fired(_watch(values)) == [2, 4]
    strict = TrendAlarm(window=2, max_growth=0.0, raise_on_alarm=True)
    strict.update({KEY: 0.1})
    with pytest.raises(MismatchGateError, match=r"grows by 100% of its level .* \(alarm above 0%"):
        strict.update({KEY: 0.3})


def test_relative_alarm_resumes_from_its_state():
    alarm, copy = TrendAlarm(window=4), TrendAlarm(window=4)
    for i, v in enumerate([0.01, 0.012, 0.02, 0.03]):
        alarm.update({KEY: v}, step=i)
    copy.load_state_dict(alarm.state_dict())
    assert copy.update({KEY: 0.05}, step=4) == alarm.update({KEY: 0.05}, step=4)


@pytest.mark.parametrize("kw,match", [
    (dict(mode="slope"), r"mode='slope' must be one of \('relative', 'absolute'\)"),
    (dict(max_growth=-0.5), "max_growth=-0.5 must be a finite number >= 0"),
    (dict(max_growth=float("inf")), "max_growth=inf must be a finite number >= 0"),
    (dict(min_level=0.0), "min_level=0.0 must be a finite number > 0"),
    (dict(mode="relative", max_slope=0.01), "max_slope=0.01 is the absolute mode's threshold: set mode='absolute'"),
    (dict(mode="absolute"), "max_slope=None must be a finite number in mode='absolute'"),
    (dict(max_slope=0.01, max_growth=1.0), "max_growth=1.0 is the relative mode's threshold"),
    (dict(max_slope=float("nan")), "max_slope=nan must be a finite number"),
    (dict(window=True), "window=True must be an int >= 2"),
])
def test_bad_trend_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        TrendAlarm(**kw)


def test_a_step_without_the_watched_metric_is_named_and_not_counted():
    """It raised a bare KeyError('mismatch/logprob_abs_diff') after counting the step."""
    alarm = TrendAlarm(window=2)
    with pytest.raises(KeyError, match=r"watches 'mismatch/logprob_abs_diff', which this step's metrics lack \(they "
                                       r"have \['reward'\]\)"):
        alarm.update({"reward": 1.0})
    assert alarm.state_dict()["count"] == 0


def test_a_value_that_is_not_a_number_is_named_and_not_counted():
    """float() raised after the update had counted: the next update sat one step further on, so a rise of 1 per update
    read as a slope of 0.5 and the alarm (above 0.75) stayed silent."""
    alarm = TrendAlarm(window=2, mode="absolute", max_slope=0.75, key="m")
    alarm.update({"m": 0.0})
    with pytest.raises(ValueError, match="the trend alarm's metric 'm' is 'n/a', not a number"):
        alarm.update({"m": "n/a"})
    out = alarm.update({"m": 1.0})
    assert out["m/slope"] == 1.0 and out["alarm/m_rising"] == 1.0 and alarm.state_dict()["count"] == 2


def test_a_state_that_fails_to_load_leaves_the_alarm_as_it_was():
    """The steps were replaced before a value failed to convert: new steps beside the old values."""
    alarm = TrendAlarm(window=3, key="m")
    for v in (1.0, 2.0):
        alarm.update({"m": v})
    before = alarm.state_dict()
    for bad in ({"steps": [5, 6], "values": [1.0, "x"], "count": 7}, {"steps": [5, 6], "values": [1.0, 2.0]}):
        with pytest.raises((ValueError, KeyError)):
            alarm.load_state_dict(bad)
        assert alarm.state_dict() == before


def test_the_absolute_mode_is_kept_for_old_settings():
    """``TrendAlarm(max_slope=...)`` (the only mode before session 41) is still the absolute alarm."""
    assert TrendAlarm(max_slope=0.01).mode == "absolute" and TrendAlarm().mode == "relative"
    assert TrendAlarm().max_growth == 1.0 and TrendAlarm(mode="absolute", max_slope=0.0).max_growth is None


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
    # a prefill mask that also marks prompt positions (e.g. the engine's whole prefill) counts response tokens only
    lt = _lt(0.8, 0.1)
    lt[~MASK] = 9.0  # prompt positions: nothing compares there
    p = phase_metrics(lt, LR, MASK, prefill_mask=custom | ~MASK)
    assert p["mismatch/prefill/tokens"] == 1.0
    assert p["mismatch/prefill/logprob_abs_diff_token_max"] == pytest.approx(0.1)


@pytest.mark.parametrize("shape", [(2, 0), (0, 4), (0, 0)], ids=["no-positions", "no-rows", "empty"])
def test_phase_metrics_of_no_positions_or_rows_have_no_tokens(shape):
    """[B, 0] log-probs: first_response_mask's argmax over no positions raised a bare IndexError."""
    mask = torch.zeros(shape, dtype=torch.bool)
    assert first_response_mask(mask).shape == shape
    p = phase_metrics(torch.zeros(shape), torch.zeros(shape), mask)
    assert p["mismatch/prefill/tokens"] == p["mismatch/decode/tokens"] == 0.0
    assert math.isnan(p["mismatch/prefill/logprob_abs_diff_token_mean"])  # no value, not a zero mismatch
    with pytest.raises(ValueError, match=r"mask must be bool \[B, S\], got shape \(4,\)"):
        first_response_mask(torch.ones(4, dtype=torch.bool))



def test_first_response_mask_marks_each_rows_first_response_token_only():
    """By hand: row 0's first response token is at 2, row 1 has none (no position marked, not position 0), row 2's
    is at 0."""
    mask = torch.tensor([[False, False, True, True], [False, False, False, False], [True, False, True, False]])
    want = torch.tensor([[False, False, True, False], [False] * 4, [True, False, False, False]])
    assert torch.equal(first_response_mask(mask), want)

def test_a_phase_without_tokens_is_nan_beside_its_count_of_zero():
    """Every response ended at its first token (max_new_tokens=1, or a stop token first): no decode position."""
    mask = torch.tensor([[False, True, False], [False, False, True]])
    p = phase_metrics(torch.where(mask, -1.5, 0.0), torch.where(mask, -1.0, 0.0), mask)
    assert p["mismatch/prefill/tokens"] == 2.0 and p["mismatch/prefill/logprob_abs_diff_token_mean"] == 0.5
    assert p["mismatch/decode/tokens"] == 0.0 and math.isnan(p["mismatch/decode/logprob_abs_diff_token_max"])


def test_metrics_are_tagged_with_the_topology():
    m = step_mismatch_metrics(_lt(0.2, 0.2), LR, MASK, kv_quantized=False, topology=dict(tp=2, ep=4, dp=1, pp=1))
    assert m["tp2_ep4_dp1_pp1/mismatch/logprob_abs_diff"] == pytest.approx(0.2)
    assert m["topology/ep"] == 4.0 and not any(k.startswith("mismatch/") for k in m)
    assert topology_prefix(tp=1, ep=1, dp=2, pp=1, cp=2) == "tp1_ep1_dp2_pp1_cp2"
    with pytest.raises(ValueError, match="ep=0"):
        topology_prefix(ep=0)
    with pytest.raises(ValueError, match=r"topology keys \['etp'\] are not among \('tp', 'ep', 'dp', 'pp', 'cp'\)"):
        step_mismatch_metrics(_lt(0.2, 0.2), LR, MASK, kv_quantized=False, topology=dict(tp=2, etp=2))


@pytest.mark.parametrize("bad", ["long", "float", "row"])
def test_phase_metrics_refuse_a_prefill_mask_that_is_not_bool_of_the_log_probs_shape(bad):
    """An integer prefill_mask indexed the log-prob diffs (d[m] gathers rows 0 and 1) instead of selecting
    positions: the decode phase of an exact rollout read the prefill's mismatch, with no error."""
    pm = first_response_mask(MASK)
    lt = _lt(0.8, 0.0)
    good = phase_metrics(lt, LR, MASK, prefill_mask=pm)
    assert good["mismatch/decode/logprob_abs_diff_token_max"] == 0.0  # (what the bad masks must not replace)
    wrong = {"long": pm.long(), "float": pm.float(), "row": pm[0]}[bad]
    with pytest.raises(ValueError, match="prefill_mask must be bool of the log-probs' shape"):
        phase_metrics(lt, LR, MASK, prefill_mask=wrong)
    with pytest.raises(ValueError, match="mask must be bool"):
        phase_metrics(lt, LR, MASK.long())


def test_growth_and_slope_use_the_given_steps_not_the_update_count():
    """By hand: 1, 2, 3, 4 at steps 0, 10, 20, 30 (e.g. logged every 10th step) rise 0.1 per step; the trend line
    rises 0.1 x 30 = 3 across the window, over a median level of 2.5: growth 1.2 (fires above 1.0)."""
    alarm = TrendAlarm(window=4)
    rows = [alarm.update({KEY: v}, step=10 * i) for i, v in enumerate([1.0, 2.0, 3.0, 4.0])]
    assert rows[-1]["mismatch/logprob_abs_diff/slope"] == pytest.approx(0.1)
    assert rows[-1][GROWTH] == pytest.approx(1.2) and rows[-1][FLAG] == 1.0


def test_a_resumed_alarm_counts_on_from_the_checkpoints_step():
    """Without explicit steps the alarm numbers updates itself: a resumed window continues at step 2, not 0."""
    alarm, copy = TrendAlarm(window=3, max_slope=0.5), TrendAlarm(window=3, max_slope=0.5)
    for v in (1.0, 2.0):
        alarm.update({KEY: v})
    copy.load_state_dict(alarm.state_dict())
    row = copy.update({KEY: 3.0})
    assert copy.state_dict() == {"steps": [0.0, 1.0, 2.0], "values": [1.0, 2.0, 3.0], "count": 3}
    assert row["mismatch/logprob_abs_diff/slope"] == pytest.approx(1.0) and row[FLAG] == 1.0


def test_growth_equal_to_the_threshold_does_not_fire():
    """The alarm fires *above* max_growth: a flat window (growth 0) under max_growth=0 stays silent."""
    assert _fired(_watch([0.1] * 12, max_growth=0.0)) == []


@pytest.mark.parametrize("kw,match", [
    (dict(prompts=[[3.9, 4]]), r"prompts holds 3.9 \(float\): token ids are ints >= 0"),
    (dict(prompts=[[True, 4]]), r"prompts holds True \(bool\)"),
    (dict(prompts=[[-1]]), r"prompts holds -1 \(int\)"),
    (dict(prompts=["12"]), r"prompts=\['12'\] must be a non-empty list of non-empty token-id lists"),
    (dict(prompts=[[1]], max_abs_diff=True), r"max_abs_diff=True must be a number >= 0 or None"),
    (dict(prompts=[[1]], max_abs_diff="0.5"), r"max_abs_diff='0.5' must be a number >= 0 or None"),
    (dict(prompts=[[1]], max_new_tokens=0), r"SentinelCheck.max_new_tokens=0: .*must be an int >= 1"),
    (dict(prompts=[[1]], max_new_tokens=2.5), r"SentinelCheck.max_new_tokens=2.5: .*must be an int >= 1"),
    (dict(prompts=[[1]], prefix=None), r"prefix=None must be a str"),
])
def test_sentinel_check_refuses_bad_settings_by_name(kw, match):
    """3.9 was token 3, True token 1, "12" the tokens 1, 2; True a bound of 1; max_new_tokens=0 was taken until the
    first sync's run."""
    with pytest.raises(ValueError, match=match):
        SentinelCheck(**kw)


def test_sentinel_check_keeps_numpy_token_ids_as_ints():
    import numpy as np

    assert SentinelCheck(prompts=[np.array([3, 4])]).prompts == ((3, 4),)
    assert SentinelCheck(prompts=[[np.int64(3), 4]], max_abs_diff=np.float32(0.5)).prompts == ((3, 4),)


@pytest.mark.parametrize("call,match", [
    (lambda: TrendAlarm(raise_on_alarm="no"), r"raise_on_alarm='no' must be a bool"),
    (lambda: TrendAlarm(key=None), r"key=None must be a metric name"),
    (lambda: TrendAlarm().update({ABS_DIFF: 0.1}, step="3"), r"step='3' must be a finite number"),
    (lambda: TrendAlarm().update({ABS_DIFF: 0.1}, step=True), r"step=True must be a finite number"),
    (lambda: TrendAlarm().update({ABS_DIFF: 0.1}, step=float("nan")), r"step=nan must be a finite number"),
    (lambda: step_mismatch_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                   kv_quantized="no"), r"kv_quantized='no' must be a bool"),
])
def test_monitor_flags_and_steps_are_checked_by_name(call, match):
    """raise_on_alarm="no" (truthy) raised on an alarm the config said to log; kv_quantized="no" added the
    prefill/decode split to a BF16 KV cache's metrics."""
    with pytest.raises(ValueError, match=match):
        call()
