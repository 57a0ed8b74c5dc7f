"""CPU smoke run of ``benchmarks/bench_packed_assembly.py``: every path reports its time and peak, the padded and
the direct assembly agree bit for bit, and the packed row holds each sample padded to a multiple of 8."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_reports_both_paths_and_they_agree(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_packed_assembly.py"), "--long", "250", "--short", "30",
           "--samples", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    r = out["compact/1x250+2x30"]
    assert r["columns_equal"] is r["samples_equal"] is True
    assert (r["packed_tokens"], r["padded_tokens"]) == (256 + 2 * 32, 3 * 250)
    assert r["payload"] == r["bytes_per_token"] * (250 + 2 * 30) and r["bytes_per_token"] == 43104
    for path in ("columns_padded", "columns_direct", "samples_padded", "samples_direct"):
        assert set(r[path]) == {"s", "cpu", "peak", "x"}, (path, r[path])
