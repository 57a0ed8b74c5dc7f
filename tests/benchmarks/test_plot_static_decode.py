"""``plot_static_decode.py``: the points it draws, and a results or ``--extra`` file without static_decode rows
refused by name (a matplotlib error of 0 columns, or an extra file drawn as nothing, before)."""

from __future__ import annotations

import json

import pytest

from .conftest import BENCHMARKS

RESULTS = BENCHMARKS / "results" / "s14" / "decode_curve_qwen3.jsonl"


def test_points_are_the_graph_rows(bench_module):
    mod = bench_module("plot_static_decode")
    points = mod.load(str(RESULTS))
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.startswith("{")]
    graph = [r for r in rows if r.get("bench") == "static_decode" and "graph_tok_s" in r]
    assert points == {(r["mode"], r["prompt"], r["batch"]): r["graph_tok_s"] for r in graph} and points


@pytest.mark.parametrize("which", ["results", "extra"])
def test_a_file_without_static_decode_rows_is_refused(bench_module, tmp_path, capsys, which):
    pytest.importorskip("matplotlib")
    mod = bench_module("plot_static_decode")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"bench": "decode", "mode": "fp4", "batch": 8}) + "\n")
    out = tmp_path / "out.png"
    args = [str(other), str(out)] if which == "results" else [str(RESULTS), str(out), "--extra", str(other)]
    with pytest.raises(SystemExit) as exc:
        mod.main(args)
    assert exc.value.code == 2 and f"{other}: no static_decode row" in capsys.readouterr().err
    assert not out.exists()
