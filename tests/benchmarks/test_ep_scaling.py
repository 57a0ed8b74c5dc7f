"""benchmarks/ep_scaling.py end to end on CPU (gloo, spawned worlds of 1 and 2 ranks, ``--smoke`` sizes), then
benchmarks/plot_ep_scaling.py on its output: every point has finite times and the guidance, cache, routing and
sync payload bytes per rank that ``guidance.planner.shard_bytes`` predicts for the point's own config."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.model_dims import ModelDims
from megatron_trace.guidance.planner import shard_bytes
from megatron_trace.guidance.selection import guided_layers

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(ROOT)}
TIMES = ("fp4_qat_step_ms", "trace_step_ms", "fp4_qat_tokens_per_s", "trace_tokens_per_s", "trace_overhead",
         "assemble_ms")
pytestmark = pytest.mark.slow  # worlds of 1 and 2 processes importing Megatron: ~20 s on 2 cores
SYNC = ("sync_s", "sync_first_s", "sync_GBps", "raw_send_s", "raw_send_GBps", "sync_vs_raw")


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "ep.jsonl"
    proc = subprocess.run([sys.executable, "benchmarks/ep_scaling.py", "--smoke", "--max-ep", "2", "--timeout", "120",
                           "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=200)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and rows and rows[-1]["ok"], (proc.stdout[-3000:], proc.stderr[-3000:])
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows  # --out holds the same lines
    return out, rows[:-1]


def test_every_point_is_there_with_finite_fields(points):
    _, rows = points
    assert sorted((r["ep"], r["mode"]) for r in rows) == [(1, "strong"), (1, "weak"), (2, "strong"), (2, "weak")]
    for r in rows:
        for k in TIMES + (SYNC if r["ep"] > 1 else ()):
            assert isinstance(r[k], float) and math.isfinite(r[k]) and (r[k] > 0 or k == "trace_overhead"), (k, r)
        assert r["guided_coverage"] == 1.0 and r["guided_layers"] == [2, 3]
        assert r["tokens_per_step"] == r["ep"] * r["batch_per_rank"] * r["shape"]["seq"]
        assert r["trace_tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["trace_step_ms"] / 1e3))
    by = {(r["ep"], r["mode"]): r for r in rows}
    assert by[(1, "weak")]["batch_per_rank"] == by[(2, "weak")]["batch_per_rank"] == 2  # weak: same per rank
    assert by[(2, "strong")]["batch_per_rank"] == 1  # strong: the global batch of 2 split over 2 ranks


def test_measured_bytes_equal_the_planner(points):
    """Independent of the script's own check: the planner recomputed here from each point's shape."""
    _, rows = points
    trace = TraceConfig(guided_layers="fraction", guided_fraction=0.5, cache_mode="compact")
    for r in rows:
        s = r["shape"]
        dims = ModelDims(num_layers=s["layers"], hidden=s["hidden"], moe_ffn=s["moe_ffn"], topk=s["topk"],
                         kv_heads=s["groups"], head_dim=s["hidden"] // s["heads"], moe_layers=tuple(range(s["layers"])),
                         kv_layers=tuple(range(s["layers"])), num_experts=s["experts"])
        want = shard_bytes(dims, trace, [s["seq"]] * r["batch_per_rank"])
        assert r["guided_layers"] == list(guided_layers(trace, s["layers"]))
        assert r["guidance_bytes_per_rank"] == want["guidance"] > 0
        assert r["cache_host_bytes_per_rank"] == want["flat"] > want["guidance"]
        assert r["routing_bytes_per_rank"] == want["routing"] > 0
        assert r["bytes_match_planner"]
        if r["ep"] > 1:  # what GuidanceSync carried to each rank (TransferStats.payload_bytes)
            assert r["sync_payload_bytes_per_rank"] == want["sync_payload"]
            assert r["sync_wire_bytes_per_rank"] > want["sync_payload"]  # + size message and JSON header
        else:
            assert r["sync_payload_bytes_per_rank"] is None and r["sync_s"] is None


def test_plot_table_and_projection(points, tmp_path):
    path, rows = points
    png, md, proj = tmp_path / "ep.png", tmp_path / "ep.md", tmp_path / "proj.json"
    proc = subprocess.run([sys.executable, "benchmarks/plot_ep_scaling.py", str(path), "--png", str(png), "--md",
                           str(md), "--json", str(proj)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = md.read_text()
    assert text.count("| yes |") == len(rows) and "**NO**" not in text
    projection = json.loads(proj.read_text())
    assert {p["model"] for p in projection} == {"Qwen3-235B-A22B", "DeepSeek-V3"}
    for p in projection:
        assert set(p["sync_seconds"]) == {"guidance sync (measured)", "raw send (measured)", "400 Gbit/s link"}
        assert p["sync_payload_bytes_per_rank"] > p["guidance_bytes_per_rank"] > 0


@pytest.mark.parametrize("argv,match", [
    (["--modes", "weak,strng"], "each mode must be one of"),
    (["--eps", "0"], "EP sizes must be ints >= 1"),
    (["--max-ep", "0"], "EP sizes must be ints >= 1"),
    (["--eps", "2,x"], "EP sizes must be ints >= 1"),
])
def test_bad_arguments_are_named(argv, match, capsys):
    sys.path.insert(0, str(ROOT))
    from benchmarks.ep_scaling import args_

    with pytest.raises(SystemExit):
        args_(argv)
    assert match in capsys.readouterr().err


def test_demo_quant_sizes_must_be_positive(capsys):
    from megatron_trace.cli.demo_quant import main

    for argv in (["--rows", "0"], ["--k", "-1"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "must be >= 1" in capsys.readouterr().err


def test_demo_quant_noise_must_be_finite(capsys):
    """--noise nan ended in a NonFiniteError traceback that did not name the flag."""
    from megatron_trace.cli.demo_quant import main

    for value in ("nan", "inf", "-0.1"):
        with pytest.raises(SystemExit):
            main(["--noise", value])
        assert f"--noise: {value} must be a finite number >= 0" in capsys.readouterr().err
