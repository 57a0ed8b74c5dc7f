"""``FP4Tensor.dequantize`` refuses codes and block scales of other dtypes than its format's: a uint8 view of E4M3
scales would decode as integers (1.0 as 56.0), silently; every format's own tensors decode."""

import dataclasses

import pytest
import torch

from megatron_trace.formats import mxfp4, nvfp4, sglang_kvfp4


@pytest.mark.parametrize("quantize", [nvfp4.quantize, mxfp4.quantize, sglang_kvfp4.quantize],
                         ids=["nvfp4", "mxfp4", "sglang_kvfp4"])
def test_dequantize_refuses_other_dtypes(quantize):
    q = quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
    want = q.dequantize()
    assert torch.isfinite(want).all()
    raw = dataclasses.replace(q, block_scales=q.block_scales.view(torch.uint8))
    with pytest.raises(ValueError, match=rf"block scales torch.uint8: fmt='{q.fmt}' needs torch.uint8 and "
                                         rf"{q.block_scales.dtype}"):
        raw.dequantize()
    with pytest.raises(ValueError, match=r"FP4Tensor codes torch.int8 and"):
        dataclasses.replace(q, codes=q.codes.view(torch.int8)).dequantize()
    assert torch.equal(dataclasses.replace(raw, block_scales=raw.block_scales.view(q.block_scales.dtype))
                       .dequantize(), want)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8])
def test_dequantize_refuses_a_non_float_output_dtype(dtype):
    """(int32 truncated 1.5 to 1 and bool made every nonzero value True, silently.)"""
    q = nvfp4.quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(TypeError, match=rf"dtype={dtype} must be a floating-point torch.dtype"):
        q.dequantize(dtype)
    assert torch.equal(q.dequantize(torch.float64), q.dequantize().double())  # (exact: fp32 values widened)


@pytest.mark.parametrize("quantize", [nvfp4.quantize, mxfp4.quantize, sglang_kvfp4.quantize],
                         ids=["nvfp4", "mxfp4", "sglang_kvfp4"])
@pytest.mark.parametrize("shape", [(4, 200), (2, 64), (4, 32), (4, 2.5)], ids=str)
def test_dequantize_refuses_a_shape_its_codes_do_not_hold(quantize, shape):
    """(was: a shape of K=200, or of 2 rows, over codes of [4, 64] dequantized as [4, 64], silently)"""
    q = quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=r"FP4Tensor of shape .* needs codes|FP4Tensor.shape=\(4, 2.5\) must be ints"):
        dataclasses.replace(q, shape=shape).dequantize()
    assert torch.equal(dataclasses.replace(q, shape=torch.Size((4, 64))).dequantize(), q.dequantize())
