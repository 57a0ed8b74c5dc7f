"""The torch reference of the FP4-weight grouped GEMM (CPU): equals an independent dense computation."""

import pytest
import torch

from megatron_trace.formats import Quantizer, e2m1
from megatron_trace.kernels import fp4_grouped_mm, grouped_mm_reference


def _dense_weights(wq):
    """Dequantize by hand from codes and scales (independent of FP4Tensor.dequantize)."""
    vals = e2m1.decode(e2m1.unpack(wq.codes))  # [E, N, K]
    b = wq.block_size
    if wq.fmt == "nvfp4":
        s_enc = 2688.0 / wq.global_amax.double()
        scale = wq.block_scales.double().repeat_interleave(b, -1) / s_enc
    else:
        scale = torch.pow(2.0, wq.block_scales.view(torch.uint8).double() - 127).repeat_interleave(b, -1)
    return vals.double() * scale


@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
def test_reference_matches_masked_dense_product(fmt, per_row):
    gen = torch.Generator().manual_seed(0)
    e, n, k = 4, 24, 64
    wq = Quantizer(fmt, per_row=per_row).quantize(torch.randn(e, n, k, generator=gen))
    offs = torch.tensor([2, 2, 7, 9], dtype=torch.int32)
    x = torch.randn(11, k, generator=gen).to(torch.bfloat16)
    y = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    w = _dense_weights(wq)  # [E, N, K]
    expert = torch.bucketize(torch.arange(11), offs.long(), right=True)  # row -> expert, E for the tail
    want = torch.zeros(11, n, dtype=torch.float64)
    for row in range(9):
        want[row] = x[row].double() @ w[expert[row]].T
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-4)  # fp32 vs fp64 scale arithmetic
    assert torch.equal(y[9:], torch.zeros(2, n))  # rows past offs[-1]


def test_w4a4_emulation_dequantizes_activations():
    gen = torch.Generator().manual_seed(1)
    wq = Quantizer("nvfp4").quantize(torch.randn(2, 16, 32, generator=gen))
    xq = Quantizer("nvfp4", per_row=True).quantize(torch.randn(5, 32, generator=gen))
    offs = torch.tensor([3, 5])
    y = grouped_mm_reference(xq, wq, offs, out_dtype=torch.float32)
    assert torch.equal(y, grouped_mm_reference(xq.dequantize(), wq, offs, out_dtype=torch.float32))
    assert torch.equal(fp4_grouped_mm(xq, wq, offs, out_dtype=torch.float32), y)  # auto -> reference on CPU


@pytest.mark.parametrize("bad,match", [
    ("offs_len", "offs must be"), ("x_k", "x.shape"), ("offs_order", "non-decreasing"), ("weight_2d", "experts, N, K"),
])
def test_bad_arguments_are_named(bad, match):
    wq = Quantizer("nvfp4").quantize(torch.randn(2, 8, 32))
    x, offs = torch.randn(4, 32), torch.tensor([1, 4])
    if bad == "offs_len":
        offs = torch.tensor([4])
    elif bad == "x_k":
        x = torch.randn(4, 16)
    elif bad == "offs_order":
        offs = torch.tensor([3, 1])
    else:
        wq = Quantizer("nvfp4").quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match=match):
        grouped_mm_reference(x, wq, offs)


@pytest.mark.parametrize("bad,match", [
    ("offs_float", r"offs must be int32/int64 of shape \[2\].*got torch.float32"),
    ("offs_past_tokens", r"offs must be non-decreasing and <= tokens=4, got \[1, 5\]"),
    ("x_3d", r"x.shape=\(1, 4, 32\) must be \[tokens, 32\]"),
    ("k_not_blocks", "K=40 must be a multiple of the nvfp4 block size 16"),
])
def test_more_bad_arguments_are_named(bad, match):
    """Offsets past the tokens were sliced away (the reference ran, the GPU kernels clamp them); float offsets, 3-D
    activations and a K of part blocks (the GPU kernels read whole blocks) each get a named error."""
    wq = Quantizer("nvfp4").quantize(torch.randn(2, 8, 32))
    x, offs = torch.randn(4, 32), torch.tensor([1, 4])
    if bad == "offs_float":
        offs = offs.float()
    elif bad == "offs_past_tokens":
        offs = torch.tensor([1, 5])
    elif bad == "x_3d":
        x = x[None]
    else:
        wq, x = Quantizer("nvfp4").quantize(torch.randn(2, 8, 40)), torch.randn(4, 40)
    with pytest.raises(ValueError, match=match):
        grouped_mm_reference(x, wq, offs)



@pytest.mark.parametrize("entry", [grouped_mm_reference, fp4_grouped_mm], ids=["reference", "dispatch"])
@pytest.mark.parametrize("bad,match", [
    ("out_int", r"out_dtype=torch.int32 must be a floating-point torch.dtype"),
    ("out_str", r"out_dtype='bf16' must be a floating-point torch.dtype"),
    ("x_int", r"x must be a float tensor \[tokens, K\] or an FP4Tensor, got torch.int64"),
    ("x_list", r"x must be a float tensor .* got list"),
    ("offs_list", r"offs must be an int32/int64 tensor \[2\] .* got list"),
    ("weight_dense", r"weight must be an FP4Tensor .* got Tensor"),
])
def test_bad_types_are_named(entry, bad, match):
    """An int out_dtype (or an int x, whose dtype the result takes) truncated the products silently; a dtype name
    failed in Tensor.to ("Invalid device string"), a list of x or offs and a dense weight raised AttributeError."""
    wq = Quantizer("nvfp4").quantize(torch.randn(2, 8, 32))
    x, offs, kw = torch.randn(4, 32), torch.tensor([1, 4]), {}
    if bad.startswith("out"):
        kw["out_dtype"] = torch.int32 if bad == "out_int" else "bf16"
    elif bad == "x_int":
        x = (x * 4).long()
    elif bad == "x_list":
        x = x.tolist()
    elif bad == "offs_list":
        offs = [1, 4]
    else:
        wq = wq.dequantize(torch.float32)
    with pytest.raises(TypeError, match=match):
        entry(x, wq, offs, **kw)

def test_an_expert_without_tokens_and_the_default_dtypes():
    """An expert with no rows (offs repeats) and a batch of no tokens; the result's dtype is x's (bf16 for FP4
    activations) unless out_dtype says otherwise."""
    gen = torch.Generator().manual_seed(2)
    wq = Quantizer("mxfp4").quantize(torch.randn(3, 8, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen).to(torch.float16)
    offs = torch.tensor([2, 2, 5], dtype=torch.int64)
    y = grouped_mm_reference(x, wq, offs)
    w = wq.dequantize(torch.float32)
    assert y.dtype == torch.float16
    assert torch.equal(y, torch.cat([x[:2].float() @ w[0].T, x[2:].float() @ w[2].T]).half())
    assert grouped_mm_reference(x[:0], wq, torch.zeros(3, dtype=torch.int32)).shape == (0, 8)
    xq = Quantizer("mxfp4").quantize(x.float())
    assert grouped_mm_reference(xq, wq, offs).dtype == torch.bfloat16

