"""The one-launch routing kernel on CUDA (skipped elsewhere): the torch routing's order, offs and inverse bit for bit
(the interpreter's cases, ``tests/kernels/test_moe_routing.py``), ``fp4_moe._routing`` taking it at decode sizes
and the torch code past its limit, replay in a CUDA graph, and ``grouped_experts_forward``'s outputs unchanged."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
    pytest.skip("needs CUDA and triton", allow_module_level=True)

from megatron_trace.config import TraceConfig  # noqa: E402
from megatron_trace.formats import Quantizer  # noqa: E402
from megatron_trace.kernels import moe_routing_triton  # noqa: E402
from megatron_trace.rollout import fp4_moe  # noqa: E402

from ..kernels.test_moe_routing import ADVERSARIAL, GRID, assert_same_routing, router_ids  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("tokens,k,e", GRID, ids=lambda v: str(v))
def test_router_ids_match_the_torch_routing(tokens, k, e):
    assert_same_routing(router_ids(tokens, k, e, seed=tokens * 1000 + k * 10 + e), e, DEV)


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_ids_match_the_torch_routing(name):
    idx, e = ADVERSARIAL[name]
    assert_same_routing(idx, e, DEV)


def test_out_of_range_ids_match_the_torch_routing():
    assert_same_routing(torch.tensor([[5, -1], [9, 3], [-2, 2], [8, 5], [70000, -40000]]), 8, DEV)


@pytest.mark.parametrize("tokens,k,e,kernel", [(8, 8, 32, True), (32, 8, 128, True), (64, 8, 128, False),
                                               (512, 8, 128, False)])
def test_routing_takes_the_kernel_where_it_fits(tokens, k, e, kernel):
    idx = router_ids(tokens, k, e).to(DEV)
    assert fp4_moe._routing_kernel_fits(idx, e) is kernel
    for a, b in zip(fp4_moe._routing(idx, e), fp4_moe._routing_torch(idx, e)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_routing_replays_in_a_cuda_graph():
    """Captured once, replayed on other ids copied into the same buffer: no host sync, fresh results."""
    idx = router_ids(8, 8, 32).to(DEV)
    moe_routing_triton.routing(idx, 32)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_routing_triton.routing(idx, 32)
    for seed in (1, 2):
        idx.copy_(router_ids(8, 8, 32, seed=seed))
        g.replay()
        for a, b in zip(out, fp4_moe._routing_torch(idx, 32)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("packed", [True, False], ids=["fp4_weights", "bf16_weights"])
@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_grouped_experts_forward_is_unchanged(monkeypatch, packed, tokens):
    """The grouped GPU path (setup of ``tests/rollout/_compiled_run._grouped_moe``) gives the same outputs, codes
    and records with the kernel routing as with the torch routing."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    e, h, ffn, k = 32, 512, 256, 8
    fc1 = torch.randn(e, 2 * ffn, h, generator=gen, device=DEV) * h**-0.5
    fc2 = torch.randn(e, h, ffn, generator=gen, device=DEV) * ffn**-0.5
    if packed:
        fc1, fc2 = Quantizer("nvfp4").quantize(fc1), Quantizer("nvfp4").quantize(fc2)
    else:
        fc1, fc2 = fc1.bfloat16(), fc2.bfloat16()
    hidden = torch.randn(tokens, h, generator=gen, device=DEV).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=gen, device=DEV)[:k] for _ in range(tokens)])
    wts = torch.softmax(torch.randn(tokens, k, generator=gen, device=DEV), -1)
    aq = TraceConfig().activation_quantizer()

    def run():
        return fp4_moe.grouped_experts_forward(hidden, idx, wts, fc1, fc2, activation_quantizer=aq,
                                               record_fc1=True, record_fc2=True)

    assert fp4_moe._routing_kernel_fits(idx, e)
    got = run()
    monkeypatch.setattr(fp4_moe, "_routing_kernel_fits", lambda *args: False)
    want = run()
    assert torch.equal(got.out, want.out)
    for a, b in ((got.fc1_in, want.fc1_in), (got.fc2_in, want.fc2_in)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.block_scales.view(torch.uint8),
                                                             b.block_scales.view(torch.uint8))
    for a, b in ((got.fc1_record, want.fc1_record), (got.fc2_record, want.fc2_record)):
        assert torch.equal(a.mantissa_bits, b.mantissa_bits)
