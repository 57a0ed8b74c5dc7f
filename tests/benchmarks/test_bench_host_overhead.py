"""CPU smoke run of ``benchmarks/bench_host_overhead.py --smoke`` (Triton's interpreter): every op runs and is
reported, and ``--cprofile`` lists functions by own time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs triton (its CPU interpreter)")
ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_reports_every_op(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}", "TORCHDYNAMO_DISABLE": "1", "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_host_overhead.py"), "--smoke", "--cprofile", "abs_max"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out["host_us_per_call"]) == {"torch_add (reference point)", "fake_quant_rows", "abs_max",
                                            "fake_quant_rows_unchecked", "fake_quant_weights", "guided_fake_quant_rows",
                                            "fake_quant_weights_given_amax", "expert_weights_getattr (128; session 21)",
                                            "expert_weights.of (128)", "expert_weights.stacked (128; with gradient)"}
    assert all(v > 0 for v in out["host_us_per_call"].values())
    assert out["cprofile"]["abs_max"] and all(len(row) == 3 for row in out["cprofile"]["abs_max"])



def test_cprofile_of_an_unknown_op_is_refused_before_timing(tmp_path):
    """``--cprofile abs_maxx`` raised a KeyError after every op had been timed (2000 calls each on the GPU)."""
    env = {"PYTHONPATH": f"{ROOT}", "TORCHDYNAMO_DISABLE": "1", "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_host_overhead.py"), "--smoke", "--cprofile",
           "abs_max,abs_maxx"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 2 and "['abs_maxx'] not among the ops: torch_add (reference point)" in res.stderr
    assert "us/call" not in res.stderr and not res.stdout  # nothing was timed
