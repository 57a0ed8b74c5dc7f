"""Issue 9 on two GPUs: ``benchmarks/two_gpu_ep.py`` (EP=2 == EP=1, tiny and mid-size) and
``benchmarks/two_gpu_disagg.py`` (rollout rank + trainer rank over NCCL), each in its own process pair.
Their JSON lines go to ``$MEGATRON_TRACE_METRICS`` when set. The CPU (gloo) runs are in
tests/rl/test_two_process_smoke.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()} (CPU runs: "
                "tests/rl/test_two_process_smoke.py)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def _run(script: str, *args: str) -> list[dict]:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=580)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    path = os.environ.get("MEGATRON_TRACE_METRICS")
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    assert proc.returncode == 0 and rows and rows[-1].get("ok"), (proc.stdout[-4000:], proc.stderr[-4000:])
    return rows


def test_ep2_equals_ep1_on_two_gpus():
    rows = [r for r in _run("two_gpu_ep.py") if not r.get("summary")]
    assert {r["model"] for r in rows} == {"tiny", "mid"} and {r["rank"] for r in rows} == {0, 1}
    for r in (r for r in rows if r["mode"] == "guided_by_ep1"):
        assert r["expert_rows_match_ep1_routing"] and r["loss_rel_diff"] < 1e-2, r
        assert all(s["code_mismatch"] == 0 for s in r["records"].values()), r["records"]


def test_disaggregated_rl_step_on_two_gpus():
    roll, train, summary = _run("two_gpu_disagg.py")
    assert train["guided_coverage"] == 1.0 and roll["fp4_codes_changed_by_sync"] > 0
    assert summary["weight_sync_fp4_bytes"] < summary["weight_sync_bf16_bytes"]
