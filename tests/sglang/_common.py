"""Shared helpers of the SGLang tests: the sglang skip reason and a tiny expert setup."""

import ast
import importlib.util

import pytest
import torch

from megatron_trace.config import TraceConfig

try:
    import sglang.srt.layers.quantization  # noqa: F401

    SGLANG_ERROR = None
except Exception as e:  # ImportError or an import-time failure of sglang's registries
    SGLANG_ERROR = f"{type(e).__name__}: {e}"

needs_sglang = pytest.mark.skipif(
    SGLANG_ERROR is not None,
    reason=f"sglang 0.5.10.post1 registries do not import here ({SGLANG_ERROR}); build the test venv with "
           "`bash tests/sglang/setup_venv.sh` and run `.venv-sglang/bin/python -m pytest tests/sglang`",
)

E, H, F, K_TOP, T = 4, 32, 16, 2, 7
CFG = TraceConfig()


def tiny_experts(seed: int = 0):
    """Trainer-side BF16 expert weights: fc1 [E, 2F, H] ([gate; up]), fc2 [E, H, F]."""
    g = torch.Generator().manual_seed(seed)
    fc1 = (torch.randn(E, 2 * F, H, generator=g) * 0.1).to(torch.bfloat16)
    fc2 = (torch.randn(E, H, F, generator=g) * 0.1).to(torch.bfloat16)
    return fc1, fc2


def tiny_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K_TOP, generator=g), -1)
    return hidden, ids, w


def source_signature(module: str, qualname: str) -> list[str]:
    """Parameter names of a function in an installed module, read from its source (no import)."""
    import os

    root = os.path.dirname(importlib.util.find_spec("sglang").origin)  # parent packages are not imported
    path = os.path.join(root, *module.split(".")[1:]) + ".py"
    tree = ast.parse(open(path).read())
    parts = qualname.split(".")
    nodes = tree.body
    for name in parts:
        node = next(n for n in nodes if getattr(n, "name", None) == name)
        nodes = getattr(node, "body", [])
    a = node.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
