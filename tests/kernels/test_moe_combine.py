"""The one-launch experts combine (``kernels.moe_combine_triton``) equals its torch spec ``combine_reference`` bit
for bit (both sum orders, any k, columns not a multiple of the block, fp32 and bf16 router weights, cancelling
sums and signed zeros), and the spec is what it says: products rounded to y's dtype, an fp32 sum in the stated
order, one rounding. On the GPU: ``tests/gpu/test_moe_combine_gpu.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ._gpu import DEVICE, HAS_TRITON, bits, needs_triton

if HAS_TRITON:
    from megatron_trace.kernels import moe_combine_triton as mc


def combine_case(tokens: int, k: int, h: int, seed: int = 0, w_dtype=torch.float32, device="cpu"):
    """(y [T*k, H] bf16, inv [T*k], weights [T, k]): expert outputs in a random row order, each token's k rows
    scaled by 2**[-12, 12] (so that the fp32 sum is inexact and its order shows) and nearly cancelling,
    router-like weights; some exact zeros and -0."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, 13, (tokens, k, 1), generator=g).float())  # (fp32 sums inexact)
    y_tok = torch.randn(tokens, k, h, generator=g) * scale
    if k > 1:
        y_tok[:, 1, : h // 4] = -y_tok[:, 0, : h // 4]  # slot 1 cancels slot 0 but for the weights
    y_tok[:, :, -1] = -0.0
    inv = torch.randperm(tokens * k, generator=g)
    y = torch.empty(tokens * k, h)
    y[inv] = y_tok.reshape(tokens * k, h)  # y[inv[t k + j]] is (token t, slot j)'s row
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(w_dtype)
    return y.to(torch.bfloat16).to(device), inv.to(device), w.to(device)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the kernel module imports it)")
@pytest.mark.parametrize("order", ["vt4", "seq"])
def test_reference_rounds_each_product_then_sums_in_fp32(order):
    """An independent loop: each product's bf16 rounding, the fp32 partial sums (slot j to partial j % 4 for
    vt4), one rounding at the end."""
    y, inv, w = combine_case(3, 6, 40, seed=1)
    got = mc.combine_reference(y, inv, w, torch.bfloat16, order)
    want = torch.empty(3, 40, dtype=torch.bfloat16)
    bf16 = lambda v: float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16))  # noqa: E731 - RNE of fp32 v
    for t in range(3):
        for c in range(40):
            parts = [np.float32(0.0)] * (4 if order == "vt4" else 1)
            for j in range(6):
                prod = np.float32(bf16(float(y[inv[t * 6 + j], c]) * bf16(float(w[t, j]))))  # (exact in fp32)
                parts[j % len(parts)] = np.float32(parts[j % len(parts)] + prod)
            acc = parts[0]
            for p in parts[1:]:
                acc = np.float32(acc + p)
            want[t, c] = bf16(float(acc))
    assert torch.equal(bits(got), bits(want))


def order_case(device="cpu"):
    """One token whose slots 0, 1 and 4 hold 2**25, 1 and -2**25 (weights 1): summed left to right the 1 is lost
    (2**25 + 1 rounds to 2**25 in fp32), in four partials (slots 0 and 4 cancel first) it stays."""
    y = torch.zeros(8, 4)
    y[0], y[1], y[4] = 2.0**25, 1.0, -(2.0**25)
    return y.to(torch.bfloat16).to(device), torch.arange(8, device=device), torch.ones(1, 8, device=device)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the kernel module imports it)")
@pytest.mark.parametrize("order,want", [("vt4", 1.0), ("seq", 0.0)])
def test_order_decides_an_inexact_sum(order, want):
    y, inv, w = order_case()
    assert mc.combine_reference(y, inv, w, torch.bfloat16, order).unique().tolist() == [want]
    if DEVICE is not None:
        y, inv, w = order_case(DEVICE)
        assert mc.combine(y, inv, w, torch.bfloat16, order).unique().tolist() == [want]


@needs_triton
@pytest.mark.parametrize("order", ["vt4", "seq"])
@pytest.mark.parametrize("tokens,k,h", [(1, 8, 64), (5, 8, 1000), (3, 6, 1024), (4, 1, 96), (2, 3, 2100)])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_the_reference_bit_for_bit(order, tokens, k, h, w_dtype):
    y, inv, w = combine_case(tokens, k, h, seed=tokens * 100 + k * 10 + h, w_dtype=w_dtype, device=DEVICE)
    got = mc.combine(y, inv, w, torch.bfloat16, order)
    assert torch.equal(bits(got), bits(mc.combine_reference(y, inv, w, torch.bfloat16, order)))


@needs_triton
def test_kernel_reads_strided_weights_and_writes_fp32():
    """Router weights as a column slice (stride 2 between slots) and an fp32 result: the same numbers."""
    y, inv, w = combine_case(4, 8, 300, seed=7, device=DEVICE)
    wide = torch.zeros(4, 16, dtype=w.dtype, device=DEVICE)
    wide[:, ::2] = w
    got = mc.combine(y, inv, wide[:, ::2], torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(bits(got), bits(mc.combine_reference(y, inv, w, torch.float32)))


@needs_triton
def test_no_tokens_gives_an_empty_result():
    y = torch.zeros(0, 32, dtype=torch.bfloat16, device=DEVICE)
    out = mc.combine(y, torch.zeros(0, dtype=torch.long, device=DEVICE), torch.zeros(0, 8, device=DEVICE),
                     torch.bfloat16)
    assert out.shape == (0, 32)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the kernel module imports it)")
@pytest.mark.parametrize("bad,match", [
    (dict(order="tree"), "order='tree' is not one of"),
    (dict(inv=torch.arange(5)), r"inv \[T\*k\]"),
    (dict(weights=torch.ones(2, 2)), r"weights \[T, k\]"),
    (dict(y=torch.zeros(5, 8, dtype=torch.bfloat16)), r"got y \(5, 8\), inv \(6,\)"),  # (the kernel: read past y)
])
def test_bad_arguments_are_named(bad, match):
    args = dict(y=torch.zeros(6, 8, dtype=torch.bfloat16), inv=torch.arange(6), weights=torch.ones(2, 3),
                dtype=torch.bfloat16, order="vt4")
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        mc.combine_reference(**args)
