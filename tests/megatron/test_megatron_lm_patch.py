"""patches/megatron-lm-core_v0.16.1-trace.patch applied to Megatron-LM's launcher: ``pretrain_gpt.py --trace-fp4``
parses, and the patched ``gpt_builder`` builds TRACE's experts and KV site (stock modules without the flag).

Megatron-LM's training code is not on the package registries: set ``MEGATRON_LM`` to a checkout of tag
``core_v0.16.1`` (patched or not: the test applies the patch to a copy; Megatron-LM's tokenizers also need ``six``).
Skipped otherwise (CI). The GPU run of
``pretrain_gpt.py`` itself is ``examples/megatron_lm/pretrain_tiny_moe.sh`` (BENCHMARKS.md, session 42)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches" / "megatron-lm-core_v0.16.1-trace.patch"
FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron/training", "megatron/legacy",
         "megatron/post_training", "megatron/rl")
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "16", "--max-position-embeddings", "16",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "32", "--ffn-hidden-size", "128", "--moe-token-dispatcher-type", "alltoall",
         "--moe-enable-routing-replay", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
         "--lr", "1e-4", "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
         "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "128"]


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    src = os.environ.get("MEGATRON_LM")
    if not src:
        pytest.skip("set MEGATRON_LM to a Megatron-LM checkout at core_v0.16.1 (its training code is not on PyPI)")
    src, dst = Path(src), tmp_path_factory.mktemp("megatron_lm")
    for f in FILES:
        (shutil.copytree if (src / f).is_dir() else shutil.copy)(src / f, dst / f)
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    applied = subprocess.run(["git", "apply", "--check", "--reverse", str(PATCH)], cwd=dst, capture_output=True)
    if applied.returncode != 0:  # not patched yet
        subprocess.run(["git", "apply", str(PATCH)], cwd=dst, check=True, capture_output=True)
    return dst


def _build(tree: Path, *flags: str) -> dict:
    path = [str(tree), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TORCHDYNAMO_DISABLE": "1"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_megatron_lm_worker.py")), *FLAGS, *flags],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_trace_fp4_builds_trace_modules_and_trains(patched):
    r = _build(patched, "--trace-fp4")
    assert r["trace_fp4"] and r["train_step_scope"]
    assert {"TraceSequentialMLP", "TraceDotProductAttention"} <= set(r["modules"])
    assert r["expert_grads"] > 0 and r["expert_grads_nonzero"] == r["expert_grads"]


def test_without_the_flag_the_stock_modules_are_built(patched):
    r = _build(patched)
    assert not r["trace_fp4"] and not any(m.startswith("Trace") for m in r["modules"])
    assert "SequentialMLP" in r["modules"] and "DotProductAttention" in r["modules"]
