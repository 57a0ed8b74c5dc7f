"""The one-launch experts combine on CUDA (skipped elsewhere): its torch spec bit for bit at the rollout's shapes,
and ``fp4_moe._combine`` taking it with the eager PyTorch combine's bits (``_combine_torch``: gather, multiply,
sum), including a sum whose fp32 order decides the result; replay in a CUDA graph."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
    pytest.skip("needs CUDA and triton", allow_module_level=True)

from megatron_trace.kernels import moe_combine_triton as mc  # noqa: E402
from megatron_trace.rollout import fp4_moe  # noqa: E402

from ..kernels._gpu import bits  # noqa: E402
from ..kernels.test_moe_combine import combine_case, order_case  # noqa: E402

pytestmark = pytest.mark.gpu
SHAPES = [(1, 8, 2048), (8, 8, 2048), (64, 8, 2048), (300, 8, 2048), (4096, 8, 2048), (16, 8, 7168), (37, 6, 1000)]
"""(tokens, k, hidden): decode and prefill token counts at Qwen3-30B-A3B's and DeepSeek-V3's hidden sizes."""


@pytest.mark.parametrize("order", mc.ORDERS)
@pytest.mark.parametrize("tokens,k,h", SHAPES, ids=str)
def test_kernel_is_the_reference_on_the_gpu(order, tokens, k, h):
    y, inv, w = combine_case(tokens, k, h, seed=tokens + k + h, device="cuda")
    got = mc.combine(y, inv, w, torch.bfloat16, order)
    assert torch.equal(bits(got), bits(mc.combine_reference(y, inv, w, torch.bfloat16, order)))


@pytest.mark.parametrize("tokens,k,h", SHAPES, ids=str)
def test_rollout_combine_takes_the_kernel_with_the_eager_bits(tokens, k, h, monkeypatch):
    y, inv, w = combine_case(tokens, k, h, seed=3 * tokens + h, device="cuda")
    want = fp4_moe._combine_torch(y, inv, w, torch.bfloat16)
    calls = []
    real = mc.combine
    monkeypatch.setattr(mc, "combine", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = fp4_moe._combine(y, inv, w, torch.bfloat16)
    assert calls and torch.equal(bits(got), bits(want))


def test_rollout_combine_sums_in_the_eager_order():
    """Slots 2**25, 1, -2**25 (slots 0, 1, 4): PyTorch's reduction keeps the 1, as the kernel's ``ORDER`` does."""
    y, inv, w = order_case("cuda")
    torch_sum = fp4_moe._combine_torch(y, inv, w, torch.bfloat16)
    assert torch.equal(bits(fp4_moe._combine(y, inv, w, torch.bfloat16)), bits(torch_sum))
    assert torch.equal(bits(torch_sum), bits(mc.combine_reference(y.cpu(), inv.cpu(), w.cpu(), torch.bfloat16)))


def test_combine_replays_in_a_cuda_graph():
    y, inv, w = combine_case(8, 8, 2048, seed=5, device="cuda")
    fp4_moe._combine(y, inv, w, torch.bfloat16)  # (compiles the kernel outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp4_moe._combine(y, inv, w, torch.bfloat16)
    y.copy_(torch.flip(y, [1]))  # new expert outputs: the replay reads them
    graph.replay()
    assert torch.equal(bits(out), bits(fp4_moe._combine_torch(y, inv, w, torch.bfloat16)))
