"""The one-launch routing kernel (``kernels.moe_routing_triton``) gives the torch routing's order, offs and inverse
bit for bit (``rollout.fp4_moe._routing_torch``: stable sort, searchsorted, scatter), on router ids, adversarial
ids (one expert, ties, odd sizes, out-of-range ids, strided and int32 indices), and where its limits are."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_trace.rollout import fp4_moe

from ._gpu import DEVICE, HAS_TRITON, needs_triton

pytestmark = needs_triton

if HAS_TRITON:
    from megatron_trace.kernels import moe_routing_triton

GRID = [(t, k, e) for t, k, e in itertools.product((1, 2, 7, 8, 64), (1, 2, 8), (8, 32, 128)) if t * k <= 256]
"""(tokens, k, experts); T=64 x k=8 (N=512) is past the one-program limit (``test_too_large_inputs_...``)."""


def router_ids(tokens: int, k: int, e: int, seed: int = 0) -> torch.Tensor:
    """int64 [T, k]: top-k of random logits, distinct experts per token (what a router gives)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, e, generator=g).topk(k, dim=-1).indices


def assert_same_routing(idx: torch.Tensor, e: int, device: str) -> None:
    """The kernel on ``device`` against the torch routing on the CPU: equal values and dtypes."""
    got = moe_routing_triton.routing(idx.to(device), e)
    want = fp4_moe._routing_torch(idx.cpu(), e)
    for name, a, b in zip(("order", "offs", "inv"), got, want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), (name, a.cpu().tolist(), b.tolist())


@pytest.mark.parametrize("tokens,k,e", GRID, ids=lambda v: str(v))
def test_router_ids_match_the_torch_routing(tokens, k, e):
    assert_same_routing(router_ids(tokens, k, e, seed=tokens * 1000 + k * 10 + e), e, DEVICE)


ADVERSARIAL = {
    "all_to_expert_0": (torch.zeros(8, 8, dtype=torch.int64), 32),
    "all_to_the_last_expert": (torch.full((7, 8), 127), 128),
    "many_ties": (torch.randint(0, 3, (32, 8), generator=torch.Generator().manual_seed(1)), 32),
    "experts_not_pow2": (router_ids(8, 8, 60), 60),
    "pairs_not_pow2": (router_ids(13, 5, 32), 32),
    "one_expert": (torch.zeros(5, 1, dtype=torch.int64), 1),
    "one_pair": (torch.tensor([[3]]), 8),
    "no_tokens": (torch.zeros(0, 8, dtype=torch.int64), 32),
    "limit_n256_e256": (torch.randint(0, 256, (32, 8), generator=torch.Generator().manual_seed(2)), 256),
    "limit_n64_e1024": (router_ids(8, 8, 1024), 1024),
    "limit_n16_e4096": (router_ids(2, 8, 4096), 4096),
    "int32_ids": (router_ids(8, 8, 32).int(), 32),
    "strided_ids": (router_ids(8, 8, 32).t().contiguous().t(), 32),  # [T, k] with strides (1, T)
    "sliced_ids": (router_ids(16, 8, 32)[::2, 1:7], 32),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_ids_match_the_torch_routing(name):
    idx, e = ADVERSARIAL[name]
    assert_same_routing(idx, e, DEVICE)


@pytest.mark.parametrize("ids", [[[5, -1], [9, 3], [-2, 2], [8, 5]], [[70000, 1], [-40000, 32767], [-32768, 0]]],
                         ids=["outside_0_E", "outside_int16"])
def test_out_of_range_ids_sort_as_in_the_torch_routing(ids):
    """Ids outside [0, E) (which the router never gives) are not dropped: they sort to the ends and count in offs
    as searchsorted counts them, and ids beyond int16 wrap as the torch path's int16 keys do."""
    assert_same_routing(torch.tensor(ids), 8, DEVICE)


@pytest.mark.parametrize("n,e,fits", [
    (0, 8, True), (1, 1, True), (64, 128, True), (256, 256, True), (257, 8, False), (256, 257, False),
    (64, 1024, True), (64, 1025, False), (16, 4096, True), (16, 4097, False), (512, 8, False),
    (8, 0, False), (-1, 8, False),
])
def test_fits_boundaries(n, e, fits):
    assert moe_routing_triton.fits(n, e) is fits


def test_too_large_inputs_raise_and_the_routing_falls_back():
    idx = router_ids(64, 8, 128)  # N = 512
    with pytest.raises(ValueError, match=r"N=512 \(tokens=64, k=8\), num_experts=128; use the torch routing"):
        moe_routing_triton.routing(idx.to(DEVICE), 128)
    assert not fp4_moe._routing_kernel_fits(idx, 128)  # fp4_moe takes the torch routing


@pytest.mark.parametrize("idx", [torch.zeros(8, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.float32)],
                         ids=["1d", "float"])
def test_bad_index_tensors_raise(idx):
    with pytest.raises(ValueError, match="must be an integer \\[T, k\\] tensor"):
        moe_routing_triton.routing(idx.to(DEVICE), 8)


def test_the_kernel_is_for_cuda_only():
    """``_routing`` keeps the torch code off CUDA (the interpreter is for tests)."""
    assert not fp4_moe._routing_kernel_fits(router_ids(8, 8, 32), 32)
