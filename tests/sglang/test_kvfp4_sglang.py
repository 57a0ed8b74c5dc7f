"""``formats.sglang_kvfp4`` bit-exact against SGLang 0.5.10.post1's own KV quantizer (``KVFP4QuantizeUtil``).

Eager here (TORCHDYNAMO_DISABLE=1: SGLang's ``@torch.compile`` runs eagerly, math in the input dtype); the
compiled run (inductor on CPU, float32 math) in a subprocess. Inductor-on-CUDA (production) is not run here.
"""

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_trace.formats import sglang_kvfp4 as kv

from ._common import needs_sglang

pytestmark = needs_sglang
ROOT = Path(__file__).resolve().parents[2]


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, 4, 64, generator=g) * torch.logspace(-8, 8, 400).reshape(-1, 1, 1)
    x[3] = 0.0
    x[5, 1, :16] = 0.0
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[7, 0, :16] = torch.cat([mids, -mids, torch.tensor([6.0, -0.0])])  # exact ties at e = 0
    x[8, 0, :16] = torch.cat([mids, -mids, torch.tensor([6.0, -0.0])]) * 2.0**-20
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_bit_exact(dtype):
    from sglang.srt.layers.quantization.kvfp4_tensor import KVFP4QuantizeUtil

    x = _inputs(dtype)
    packed, scales = KVFP4QuantizeUtil.batched_quantize(x)  # [T, heads, hd/2], [T, heads*hd/16] uint8
    q = kv.quantize(x)
    ours_packed, ours_scales = kv.to_sglang(q)
    assert torch.equal(packed, ours_packed) and torch.equal(scales, ours_scales)
    for out_dtype in (torch.bfloat16, torch.float32):
        want = KVFP4QuantizeUtil.batched_dequantize(packed, scales, out_dtype)
        assert torch.equal(want, kv.dequantize(kv.from_sglang(packed, scales), out_dtype))


COMPILED = textwrap.dedent("""
    import torch
    from sglang.srt.layers.quantization.kvfp4_tensor import KVFP4QuantizeUtil
    from megatron_trace.formats import sglang_kvfp4 as kv
    from tests.sglang.test_kvfp4_sglang import _inputs
    x = _inputs(torch.bfloat16, seed=1)
    p, s = KVFP4QuantizeUtil.batched_quantize(x)
    p2, s2 = kv.to_sglang(kv.quantize(x, compute_dtype=torch.float32))
    e2 = kv.to_sglang(kv.quantize(x))[1]
    print("RESULT", torch.equal(p, p2), torch.equal(s, s2), bool((s != e2).any()))
""")


@pytest.mark.slow
def test_compiled_bit_exact_with_float32_math():
    """SGLang's function compiled by inductor (CPU) equals compute_dtype=float32, and differs from eager bf16."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", COMPILED], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, r.stderr[-3000:]
    assert line[0].split()[1:] == ["True", "True", "True"]


def _source(module: str) -> ast.Module:
    root = os.path.dirname(importlib.util.find_spec("sglang").origin)
    return ast.parse(open(os.path.join(root, *module.split(".")[1:]) + ".py").read())


def test_pool_stores_what_the_quantizer_returns():
    """MHATokenToKVPoolFP4 (does not import on CPU): set_kv_buffer quantizes K and V with batched_quantize and
    stores codes / scales at ``loc`` in ``k_buffer`` / ``k_scale_buffer`` (what ``capture.kv_rows`` reads)."""
    tree = _source("sglang.srt.mem_cache.memory_pool")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MHATokenToKVPoolFP4")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "set_kv_buffer")
    calls = {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    assert "KVFP4QuantizeUtil.batched_quantize" in calls
    stores = {ast.unparse(t) for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets}
    for name in ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer"):
        assert f"self.{name}[layer_id - self.start_layer][loc]" in stores, name
    create = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_create_buffers")
    text = ast.unparse(create)
    assert "(m, n, k // 2)" in text and "(m, n * k // scale_block_size)" in text and "scale_block_size = 16" in text
