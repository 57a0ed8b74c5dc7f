"""``benchmarks/profile_step_host.py`` on the CPU: the hook timer's own times add up to each step's time, a step is
one call of the root module (the prefill, then one per fed token), and the smoke run of it and of
``profile_host.py`` (which share ``bench_decode.generate_parser`` / ``backends_of``) report both modes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.inner(x) + self.inner(x))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_own_times_add_up_to_each_step(bench_module):
    timer_cls = bench_module("profile_step_host").ModuleHostTimer
    net = _Net()
    timer = timer_cls(net)
    net(torch.randn(2, 4))  # (off: not recorded)
    timer.on = True
    for _ in range(3):
        net(torch.randn(2, 4))
    timer.on = False
    timer.remove()
    net(torch.randn(2, 4))
    assert len(timer.steps) == 3 and not timer.stack
    for step in timer.steps:
        own = sum(v for k, v in step.items() if k != "(step)")
        assert abs(own - step["(step)"]) <= 1e-9 + 1e-9 * step["(step)"]
        assert set(step) == {"(step)", "_Net", "_Block", "Linear", "LayerNorm"}


def _run(script: str, *args: str) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--batch", "2", "--prompt", "8", "--tokens",
           "3", "--reps", "1", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    return [json.loads(line) for line in res.stdout.splitlines()]


def test_smoke_runs_report_both_modes():
    rows = _run("profile_step_host.py", "--timed", "3")
    assert [r["mode"] for r in rows] == ["bf16", "fp4"]
    for r in rows:
        assert len(r["decode_step_host_ms"]) == 3  # one eager fixed-buffer step per fed token
        assert "Qwen3MoeExperts" in r["decode_median_step_own_ms"] and r["prefill_host_ms"] > 0
        assert len(r["prefill_host_ms_runs"]) == 3 and r["prefill_host_ms"] == sorted(r["prefill_host_ms_runs"])[1]
        assert abs(r["prefill_own_ms"]["(step)"] - r["prefill_host_ms"]) < 0.006  # the median prefill's own times
    rows = _run("profile_host.py", "--top", "3")
    assert [r["mode"] for r in rows] == ["bf16", "fp4"] and all(len(r["by_own_time"]) == 3 for r in rows)
