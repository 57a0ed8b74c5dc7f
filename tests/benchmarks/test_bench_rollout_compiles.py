"""CPU smoke run of ``benchmarks/bench_rollout_compiles.py --smoke`` (tiny model, reference paths: no Triton)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_times_each_generate_at_its_width_and_counts_no_compiles_without_triton(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_rollout_compiles.py"), "--smoke", "--batch", "2",
           "--widths", "4,7", "--tokens", "5", "--rounds", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    gens = [r for r in rows if r["bench"] == "rollout_compiles"]
    assert [(r["mode"], r["round"], r["prompt"]) for r in gens] == [
        (m, i, w) for m in ("bf16", "fp4") for i, w in enumerate((4, 7, 4))]
    assert all(r["new_tokens"] == 5 and r["sec"] > 0 and r["compiles"] == 0 and r["by_kernel"] == {} for r in gens)
    summary = rows[-1]
    assert summary["bench"] == "rollout_compiles_summary" and summary["triton_cache_dir"] is None
    assert summary["compiles"] == {"bf16": [0, 0, 0], "fp4": [0, 0, 0]} and set(summary["first_over_last"]) == {
        "bf16", "fp4"}
