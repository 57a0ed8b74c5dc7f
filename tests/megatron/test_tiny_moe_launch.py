"""``examples/megatron_lm/pretrain_tiny_moe.sh`` (the README's complete Megatron-LM launch without Transformer Engine)
starts ``pretrain_gpt.py`` with megatron-core's router usable: without TE, megatron-core 0.16.1's MoE router reads
``moe_utils.te_general_gemm``, which only TE defines, so the script defines it in the launched processes.

Run here with a stand-in ``torchrun`` (it runs the script's ``pretrain_gpt.py`` in this Python) and a stand-in
``pretrain_gpt.py`` that reports what the real one would meet."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "megatron_lm" / "pretrain_tiny_moe.sh"

STUB = """import json, sys
import megatron.core.transformer.moe.moe_utils as moe_utils
seen = {"te_general_gemm": hasattr(moe_utils, "te_general_gemm"), "argv": sys.argv[1:]}
json.dump(seen, open(sys.argv[0] + ".json", "w"))
"""


def test_the_launch_defines_the_routers_te_general_gemm(tmp_path):
    mlm, bin_dir = tmp_path / "Megatron-LM", tmp_path / "bin"
    mlm.mkdir()
    bin_dir.mkdir()
    (mlm / "pretrain_gpt.py").write_text(STUB)
    torchrun = bin_dir / "torchrun"  # drops torchrun's own options, runs the script with its arguments
    torchrun.write_text(f'#!/usr/bin/env bash\nwhile [[ $# -gt 0 && "$1" != *.py ]]; do shift; done\n'
                        f'exec "{sys.executable}" "$@"\n')
    torchrun.chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)  # the script's Transformer Engine check: this environment's
    env = {**os.environ, "MEGATRON_LM": str(mlm), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(["bash", str(SCRIPT), "--trace-fp4"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads((mlm / "pretrain_gpt.py.json").read_text())
    assert seen["te_general_gemm"], "pretrain_gpt.py would meet the router's NameError (TRACE's experts refuse)"
    assert seen["argv"][-1] == "--trace-fp4" and "--transformer-impl" in seen["argv"]
