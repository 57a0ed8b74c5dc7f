"""Decode attention over an FP4 KV cache: the torch reference (CPU) and its dispatch; the Triton kernel is
checked on the GPU (tests/gpu/test_kv_attention_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_trace.formats import Quantizer
from megatron_trace.kernels.kv_attention import fp4kv_decode_attention, reference_attention


def _case(seed, b=3, hq=8, hkv=2, t=21, d=32, fmt="nvfp4"):
    g = torch.Generator().manual_seed(seed)
    quant = Quantizer(fmt, per_row=fmt == "nvfp4")
    k = quant.quantize(torch.randn(b, hkv, t, d, generator=g))
    v = quant.quantize(torch.randn(b, hkv, t, d, generator=g))
    return torch.randn(b, hq, d, generator=g), k, v


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reference_is_sdpa_on_bf16_dequantized_kv(fmt):
    q, k, v = _case(0, fmt=fmt)
    kd = k.dequantize(torch.bfloat16).float().repeat_interleave(4, 1)  # GQA: 4 query heads per KV head
    vd = v.dequantize(torch.bfloat16).float().repeat_interleave(4, 1)
    want = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd).squeeze(2)
    assert torch.allclose(reference_attention(q, k, v), want, atol=1e-5)
    assert torch.equal(fp4kv_decode_attention(q, k, v), reference_attention(q, k, v))  # auto -> reference on CPU


def test_lengths_mask_each_sequence_tail():
    q, k, v = _case(1)
    lengths = torch.tensor([21, 4, 1])
    got = reference_attention(q, k, v, lengths=lengths)
    for i, n in enumerate(lengths.tolist()):
        ki = k.dequantize(torch.bfloat16)[i : i + 1, :, :n].float().repeat_interleave(4, 1)
        vi = v.dequantize(torch.bfloat16)[i : i + 1, :, :n].float().repeat_interleave(4, 1)
        want = F.scaled_dot_product_attention(q[i : i + 1].unsqueeze(2), ki, vi).squeeze(2)
        assert torch.allclose(got[i : i + 1], want, atol=1e-5)


@pytest.mark.parametrize("bad,match", [("hq", "multiple of Hkv"), ("d", "does not fit"), ("len", "lengths"),
                                       ("kernel", "kernel='triton' cannot run")])
def test_bad_arguments_are_named(bad, match):
    q, k, v = _case(2)
    lengths, kernel = None, "auto"
    if bad == "hq":
        q = q[:, :7]
    elif bad == "d":
        q = q[..., :16]
    elif bad == "len":
        lengths = torch.tensor([1, 2])
    else:
        kernel = "triton"
    with pytest.raises(ValueError, match=match):
        fp4kv_decode_attention(q, k, v, lengths=lengths, kernel=kernel)
