"""CPU smoke run of ``benchmarks/bench_long_context.py`` at 512 tokens: every path runs and reports its time and
peak, and the stored guidance is the payload ``guidance.accounting`` predicts (the benchmark's ``x`` is against it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("split", "recorder", "cache_put", "cache_get", "cache_assemble", "cache_flat_put", "cache_flat_get",
         "spill_put", "spill_get", "spill_get_each", "wire_encode", "wire_decode", "assemble", "assemble_packed",
         "routing_split", "routing_assemble", "pack_step", "sync_send", "sync_receive")


def test_smoke_run_reports_every_path_against_the_accounted_payload(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}", "TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_long_context.py"), "--tokens", "512", "--tmp",
           str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out) == {"compact/1x512", "full/1x512"}
    for key, r in out.items():
        assert r["guidance_nbytes"] == r["payload"] == 512 * r["bytes_per_token"], key
        for path in PATHS:
            assert set(r[path]) == {"s", "cpu", "peak", "x"}, (key, path, r[path])
    # by hand, per token and guided layer (24 of Qwen3-30B-A3B's 48), payload + E4M3 scale per 16 + fp32 amax per row:
    # compact: FC1 2048/8 + 128 + 4, FC2 8 x (768/8 + 48 + 4), K and V 4 x (128/8 + 8 + 4) each = 1796 B;
    # full:    FC1 2048/2 + 128 + 4, FC2 8 x (768/2 + 48 + 4), K and V 4 x (128/2 + 8 + 4) each = 5252 B
    assert (1796 * 24, 5252 * 24) == (43104, 126048)
    assert (out["compact/1x512"]["bytes_per_token"], out["full/1x512"]["bytes_per_token"]) == (43104, 126048)
