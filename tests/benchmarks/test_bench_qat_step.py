"""CPU smoke run of ``benchmarks/bench_qat_step.py --smoke --profile`` (tiny Megatron MoE, reference kernels)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}


def _run(tmp_path, *flags: str) -> dict:
    """``bench_qat_step.py --smoke --kernels reference *flags`` in a subprocess: its JSON line."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_qat_step.py"), "--smoke", "--kernels", "reference", *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_smoke_run_times_and_profiles_every_variant(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_qat_step.py"), "--smoke", "--profile",
           "--kernels", "reference"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    names = {"bf16_stock", "bf16_grouped", "fp4_qat[reference]", "trace_guided[reference]"}
    assert set(out["step_ms"]) == names == set(out["profile"])
    assert all(math.isfinite(v) and v > 0 for v in out["step_ms"].values())
    assert out["ratio_vs_bf16_grouped"]["bf16_grouped"] == 1.0
    for name, p in out["profile"].items():
        assert p["self_time_ms_total"] > 0 and p["top_ops_ms"], name
        assert p["host_blocking_calls"] == {}  # CPU: no CUDA runtime calls
    assert any("FakeQuant" in op for op, _, _ in out["profile"]["trace_guided[reference]"]["top_ops_ms"])


def test_variant_subset_with_manual_gc_and_micro_batches_reports_round_ratios(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_qat_step.py"), "--smoke", "--kernels", "reference",
           "--micro-batches", "2", "--variants", "fp4_qat,trace_guided", "--gc", "manual"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out["step_ms"]) == {f"{v}{r}[reference]" for v in ("fp4_qat", "trace_guided") for r in ("", "+reuse")}
    assert out["gc"] == "manual" and out["micro_batches"] == 2 and out["ratio_vs_bf16_grouped"] is None
    ratios = out["round_ratio_median"]
    assert set(ratios) == {"trace_guided[reference]/fp4_qat[reference]",
                           "trace_guided+reuse[reference]/fp4_qat+reuse[reference]"}
    assert all(math.isfinite(r) and r > 0 for r in ratios.values())
    bad = subprocess.run(cmd[:-4] + ["--variants", "fp8_qat"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode != 0 and "fp8_qat" in bad.stderr


def test_stack_copy_times_the_torch_experts_with_their_weights_stacked_by_a_copy(tmp_path):
    out = _run(tmp_path, "--variants", "bf16_grouped,fp4_qat", "--stack-copy", "--warmup", "1", "--reps", "2")
    assert set(out["step_ms"]) == {"bf16_grouped", "bf16_grouped+stack", "fp4_qat[reference]",
                                   "fp4_qat+stack[reference]"}
    assert {"bf16_grouped/bf16_grouped+stack", "fp4_qat[reference]/fp4_qat+stack[reference]"} <= set(
        out["round_ratio_median"])


def test_prechecked_times_the_guided_step_with_records_checked_before_it(tmp_path):
    out = _run(tmp_path, "--variants", "fp4_qat,trace_guided", "--prechecked", "--warmup", "1", "--reps", "2")
    assert set(out["step_ms"]) == {"fp4_qat[reference]", "trace_guided[reference]",
                                   "trace_guided+checked[reference]"}
    assert {"trace_guided+checked[reference]/fp4_qat[reference]",
            "trace_guided[reference]/trace_guided+checked[reference]"} <= set(out["round_ratio_median"])
