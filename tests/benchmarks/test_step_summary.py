"""``step_summary.py``: the lines a device session prints from a ``bench_qat_step.py`` result."""

from __future__ import annotations

import json


def test_summary_lists_times_ratios_and_each_variants_gaps(bench_module, tmp_path, capsys):
    mod = bench_module("step_summary")
    result = {"step_ms": {"bf16_grouped": 104.7, "fp4_qat[auto]": 112.6}, "round_ratio_median": {"a/b": 1.07},
              "gaps": {"fp4_qat[auto]": {"span_ms": 114.8, "idle_ms": 11.5, "other": 1,
                                         "by_launching_op": [["_FakeQuant", 11, 3.28], ["aten::cat", 4, 1.42]]}}}
    lines = mod.summary(result, top=1)
    assert json.loads(lines[0]) == result["step_ms"] and json.loads(lines[1]) == {"a/b": 1.07}
    assert lines[2] == '== fp4_qat[auto] {"span_ms": 114.8, "idle_ms": 11.5}'
    assert lines[3:] == ["    ['_FakeQuant', 11, 3.28]"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"step_ms": {"x": 1.0}}))
    mod.main([str(path)])
    assert capsys.readouterr().out.splitlines() == ['{"x": 1.0}', "{}"]
