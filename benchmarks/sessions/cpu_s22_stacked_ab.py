"""Session 22, CPU: host us per call of ``expert_weights._storage_view`` / ``stacked`` for 128 packed weights,
session 21's module (commit 9b7b04e, read with ``git show``) against the working tree's, three alternating rounds.
    python3 benchmarks/sessions/cpu_s22_stacked_ab.py   (from the repo root; prints one JSON line)
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.getcwd())
from megatron_trace.megatron import expert_weights as new  # noqa: E402

src = subprocess.run(["git", "show", "9b7b04e:megatron_trace/megatron/expert_weights.py"], check=True,
                     capture_output=True, text=True).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
    fh.write(src)
spec = importlib.util.spec_from_file_location("expert_weights_s21", fh.name)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
weights = [torch.nn.Parameter(torch.randn(32, 16)) for _ in range(128)]
new.pack(weights)


def us(fn, n=5000):
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - t0) / n * 1e6, 1)


res = {}
for _ in range(3):
    for name, mod in (("session 21", old), ("session 22", new)):
        res.setdefault(f"_storage_view, {name}", []).append(us(lambda m=mod: m._storage_view(weights)))
        res.setdefault(f"stacked (with gradient), {name}", []).append(us(lambda m=mod: m.stacked(weights)))
print(json.dumps({"bench": "cpu_s22_stacked_ab", "torch": torch.__version__, "us_per_call": res}))
