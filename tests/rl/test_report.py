"""The demo's summary table (``rl.report``): the headline ratio of each arm's mismatch to the BF16 floor."""

import math

import pytest

from megatron_trace.rl import report


def _rows(diffs: list[float]) -> list[dict]:
    return [{"step": float(i), "reward": 0.5, "mismatch/logprob_abs_diff": d} for i, d in enumerate(diffs)]


def test_summary_divides_each_arms_mismatch_by_the_bf16_floor_of_the_run():
    rows = report.summary_rows({"bf16": _rows([1e-3, 3e-3]), "trace": _rows([3e-3, 5e-3]), "fp4_qat": _rows([8e-3])})
    header, table = rows[0], {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert header.index("logprob_abs_diff / bf16 floor") == header.index("logprob_abs_diff") + 1
    assert len(header) == len(report.SUMMARY_KEYS) + 2 and all(len(r) == len(header) for r in rows)
    # means over all steps: floor 2e-3, trace 4e-3, fp4_qat 8e-3
    got = {a: t["logprob_abs_diff / bf16 floor"] for a, t in table.items()}
    assert got == {"bf16": "1x", "trace": "2x", "fp4_qat": "4x"}


def test_without_the_bf16_arm_there_is_no_floor_column():
    rows = report.summary_rows({"trace": _rows([3e-3])})
    assert "logprob_abs_diff / bf16 floor" not in rows[0] and len(rows[0]) == len(report.SUMMARY_KEYS) + 1
    rows = report.summary_rows({"bf16": [{"step": 0.0, "reward": 0.0}], "trace": _rows([3e-3])})  # no floor value
    assert [r[rows[0].index("logprob_abs_diff / bf16 floor")] for r in rows[1:]] == ["-", "-"]


def test_a_resume_drops_the_row_the_killed_run_was_writing(tmp_path):
    """A run that died appending a long row (one buffer of it on disk) left a partial last line: the resumed run's
    truncate then raised JSONDecodeError on it, and no resume could start. That row is dropped (its step is redone),
    the other rows kept as they were."""
    import json

    from megatron_trace.rl.report import MetricsWriter, load

    w = MetricsWriter(tmp_path, fresh=True)
    w.write("bf16", 0, {"reward": 1.0})
    w.write("trace", 0, {"reward": 0.5})
    w.write("trace", 1, {"reward": 0.75})
    row = json.dumps({"arm": "trace", "step": 2, **{f"quant/layer_{i}/rate": 0.1 for i in range(1000)}}) + "\n"
    with w.path.open("a") as f:
        f.write(row[:8192])
    MetricsWriter(tmp_path).truncate("trace", 2)
    assert {a: [(r["step"], r["reward"]) for r in rows] for a, rows in load(w.path).items()} == {
        "bf16": [(0, 1.0)], "trace": [(0, 0.5), (1, 0.75)]}
    assert w.path.read_text().endswith("\n") and not (tmp_path / "metrics.jsonl.tmp").exists()
    MetricsWriter(tmp_path).truncate("trace", 1)  # the resumed run's own rows after its checkpoint, as before
    assert [r["step"] for r in load(w.path)["trace"]] == [0]


def test_summary_cells_by_hand():
    """reward: mean of the last 3 steps; mismatch/quant/time: mean over every step that has them; the rest: last."""
    rows = [{"step": float(i), "reward": r, "eval/accuracy": a, "time/step_s": t} for i, (r, a, t) in
            enumerate(zip([0.1, 0.2, 0.3, 0.4, 0.5], [0.5, 0.5, 0.6, 0.6, 0.7], [1.0, 2.0, 3.0, 4.0, 5.0]))]
    for i, q in enumerate([0.1, 0.2, 0.3]):  # quant metrics measured on the first three steps only
        rows[i]["quant/expert_fc1_in/code_mismatch_rate"] = q
    table = report.summary_rows({"fp4_qat": rows})
    cell = dict(zip(table[0], table[1]))
    assert cell["final reward (last 3 steps)"] == "0.4"
    assert cell["held-out greedy accuracy"] == "0.7"
    assert cell["FC1 code mismatch"] == "0.2"
    assert cell["step time (s)"] == "3"
    assert cell["logprob_abs_diff"] == "-"


def test_truncate_drops_only_the_resumed_arms_rows(tmp_path):
    from megatron_trace.rl.report import MetricsWriter, load

    w = MetricsWriter(tmp_path, fresh=True)
    for step in range(3):
        for arm in ("bf16", "trace"):
            w.write(arm, step, {"reward": float(step)})
    MetricsWriter(tmp_path).truncate("trace", 1)
    assert {a: [r["step"] for r in rows] for a, rows in load(w.path).items()} == {"bf16": [0, 1, 2], "trace": [0]}


def test_plots_of_a_run_with_per_layer_rates_are_written(tmp_path):
    """Every figure of the demo's report is written as a PNG, the per-layer bars parsed from
    ``quant/expert_fc1_in/layer_<L>/code_mismatch_rate`` keys (the writer's own rows)."""
    from megatron_trace.metrics import QuantCounts, quant_metrics
    from megatron_trace.rl.report import MetricsWriter, load

    w = MetricsWriter(tmp_path, fresh=True)
    q = quant_metrics({(layer, "expert_fc1_in"): QuantCounts(elements=100, mismatched=layer + 1) for layer in (0, 1)})
    for arm in ("bf16", "fp4_qat", "trace", "trace_full"):
        for step in range(2):
            w.write(arm, step, {"reward": 0.5, "mismatch/logprob_abs_diff": 1e-3, "mismatch/kl_k3": 1e-5,
                                "cache/bytes_per_token": 64.0, **q})
    w.close()
    paths = report.plot(load(w.path), tmp_path)
    assert [p.name for p in paths] == ["reward.png", "mismatch.png", "code_mismatch_per_layer.png", "cache_bytes.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_the_writer_keeps_booleans_and_stores_numbers_as_floats(tmp_path):
    """An alarm's True stays a JSON boolean (not 1.0); ints and 0-d tensors become floats; a fresh writer removes the
    earlier run's TensorBoard events beside its metrics."""
    import torch

    from megatron_trace.rl.report import MetricsWriter, load

    (tmp_path / "tb" / "old").mkdir(parents=True)
    w = MetricsWriter(tmp_path, fresh=True)
    assert not (tmp_path / "tb" / "old").exists()
    w.write("trace", 0, {"alarm/rising": True, "n": 3, "t": torch.tensor(0.5), "name": "x"})
    w.close()
    (row,) = load(w.path)["trace"]
    assert row["alarm/rising"] is True and row["n"] == 3.0 and isinstance(row["n"], float) and row["t"] == 0.5
    assert row["name"] == "x"


def test_summary_means_over_fewer_steps_than_the_window_and_a_zero_floor():
    """Two steps of reward: the mean of those two (the 3-step window is not filled); a bf16 floor of 0 gives no ratio
    (no ZeroDivisionError); the markdown table has one separator cell per column."""
    rows = report.summary_rows({"bf16": [{"step": 0.0, "reward": 0.2, "mismatch/logprob_abs_diff": 0.0},
                                         {"step": 1.0, "reward": 0.4, "mismatch/logprob_abs_diff": 0.0}],
                                "trace": _rows([3e-3])})
    cells = {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert cells["bf16"]["final reward (last 3 steps)"] == "0.3"
    assert cells["bf16"]["logprob_abs_diff / bf16 floor"] == cells["trace"]["logprob_abs_diff / bf16 floor"] == "-"
    lines = report.markdown_table(rows).splitlines()
    assert len(lines) == 1 + len(rows) and len({ln.count("|") for ln in lines}) == 1


def test_a_fresh_flag_that_is_no_bool_is_refused_and_removes_nothing(tmp_path):
    """fresh="no" (truthy) deleted the earlier run's metrics.jsonl."""
    from megatron_trace.rl.report import MetricsWriter, load

    MetricsWriter(tmp_path, fresh=True).write("trace", 0, {"reward": 0.5})
    for bad in ("no", 0, None):
        with pytest.raises(ValueError, match=f"fresh={bad!r} must be a bool"):
            MetricsWriter(tmp_path, fresh=bad)
    assert load(tmp_path / "metrics.jsonl")["trace"][0]["reward"] == 0.5


@pytest.mark.parametrize("arm,step,match", [
    ("trace", "3", r"step='3' must be an int"),
    ("trace", 2.5, r"step=2.5 must be an int"),
    ("trace", True, r"step=True must be an int"),
    (None, 1, r"arm=None must be the arm's name"),
])
def test_rows_of_a_step_that_is_no_int_are_refused(tmp_path, arm, step, match):
    """A step "3" was written as a string, and the resume's truncate compared it with an int (a TypeError)."""
    from megatron_trace.rl.report import MetricsWriter

    w = MetricsWriter(tmp_path, fresh=True)
    with pytest.raises(ValueError, match=match):
        w.write(arm, step, {"reward": 1.0})
    with pytest.raises(ValueError, match=match):
        w.truncate(arm, step)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_an_out_dir_that_is_a_file_is_named(tmp_path):
    """It was mkdir's bare "[Errno 17] File exists"."""
    from megatron_trace.rl.report import MetricsWriter

    f = tmp_path / "run"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"out_dir=.* is a file: give the run's output directory"):
        MetricsWriter(f)


@pytest.mark.parametrize("key,label,n", [("reward", "final reward (last 3 steps)", 3),
                                         ("mismatch/logprob_abs_diff", "logprob_abs_diff", 5),
                                         ("cache/bytes_per_token", "guidance bytes/token", 1)])
def test_a_null_value_in_the_window_is_nan_not_a_mean_of_other_steps(tmp_path, key, label, n):
    """A metric written as None (JSON null) on the last step was dropped: the cell showed the mean of earlier steps as
    if they were the window. It reads NaN; a window without the null is the mean of its own steps."""
    from megatron_trace.rl.report import MetricsWriter, load

    w = MetricsWriter(tmp_path, fresh=True)
    for step in range(5):
        w.write("trace", step, {key: None if step == 4 else float(step + 1)})
        w.write("bf16", step, {key: float(step + 1)})
    w.close()
    rows = report.summary_rows(load(w.path))
    cells = {r[0]: r[rows[0].index(label)] for r in rows[1:]}
    assert cells["trace"] == "nan"
    assert float(cells["bf16"]) == sum(range(6 - n, 6)) / n


def test_the_cache_bar_is_the_last_row_that_has_it(tmp_path):
    """The bar read the arm's last row, a row without cache/bytes_per_token drawing 0 (the summary said the last
    value); an arm that never had it draws no bar (NaN), not 0."""
    import matplotlib.axes

    from megatron_trace.rl.report import MetricsWriter, load

    w = MetricsWriter(tmp_path, fresh=True)
    for step in range(3):
        w.write("trace", step, {"reward": 0.5, **({"cache/bytes_per_token": 60.0 + step} if step < 2 else {})})
        w.write("trace_full", step, {"reward": 0.5})
    w.close()
    bars, orig = [], matplotlib.axes.Axes.bar

    def bar(ax, x, h, *a, **k):  # (the heights drawn; matplotlib's own bar draws them)
        bars.append((list(x), list(h)))
        return orig(ax, x, h, *a, **k)

    try:
        matplotlib.axes.Axes.bar = bar
        report.plot(load(w.path), tmp_path)
    finally:
        matplotlib.axes.Axes.bar = orig
    (x, h), = [b for b in bars if b[0] == ["trace", "trace_full"]]
    assert h[0] == 61.0 and math.isnan(h[1])


def test_tensorboard_has_each_step_once_after_a_resume_and_its_nan_and_inf(tmp_path):
    """A resumed run's redone steps appeared in TensorBoard twice (the old run's value beside the new), and NaN / Inf
    values were left out of it, silently: the redone steps are purged and non-finite values written as such."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_trace.rl.report import MetricsWriter

    w = MetricsWriter(tmp_path, fresh=True)
    for step in range(3):
        w.write("trace", step, {"reward": float(step), "x": math.nan if step == 1 else 1.0})
    w.close()
    w = MetricsWriter(tmp_path)
    w.truncate("trace", 1)
    for step in (1, 2):
        w.write("trace", step, {"reward": 10.0 + step, "x": math.inf})
    w.close()
    ea = EventAccumulator(str(tmp_path / "tb" / "trace"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("reward")] == [(0, 0.0), (1, 11.0), (2, 12.0)]
    assert [(e.step, e.value) for e in ea.Scalars("x")] == [(0, 1.0), (1, math.inf), (2, math.inf)]
