"""``benchmarks/count_step_ops.py`` attributes a step's torch ops to megatron_trace source lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_guided_ops_are_attributed_to_the_guided_plumbing(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "count_step_ops.py"), "--top", "200"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    qat, guided = out["fp4_qat"], out["trace_guided"]
    assert out["guided_minus_qat_ops"] == guided["total_ops"] - qat["total_ops"] > 0
    files = {line.split(":")[0] for line, _ in guided["top"]}
    assert {"megatron/moe_step.py", "megatron/facts.py"} <= files  # router hooks, step facts
    assert not any(line.startswith("megatron/moe_step.py") for line, _ in qat["top"])  # no guidance context
