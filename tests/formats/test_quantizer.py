"""``Quantizer`` / ``fake_quantize`` and SGLang's KV quantizer: policy checks, clip masks and output dtypes."""

import pytest
import torch

from megatron_trace.formats import Quantizer, fake_quantize, get_format, mxfp4, nvfp4
from megatron_trace.formats import sglang_kvfp4 as kv


def _x(k=40, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, k, generator=g) * torch.logspace(-2, 2, 4).unsqueeze(1)).to(dtype)


@pytest.mark.parametrize("kw,match", [
    ({"fmt": "mxfp4", "per_row": True}, "per_row applies to nvfp4 only, got fmt='mxfp4'"),
    ({"rounding": "up"}, r"rounding='up' is not one of \('rne', 'stochastic'\)"),
    ({"fmt": "sglang_kvfp4"}, r"fmt='sglang_kvfp4' is not one of \('nvfp4', 'mxfp4'\)"),  # record-only format
    # were accepted: "no" is truthy (ste_clip="no" clipped the gradient, per_row="no" gave one amax per row)
    ({"ste_clip": "no"}, "ste_clip='no' must be a bool"), ({"ste_clip": None}, "ste_clip=None must be a bool"),
    ({"per_row": "no"}, "per_row='no' must be a bool"), ({"per_row": 1}, "per_row=1 must be a bool"),
])
def test_a_bad_policy_is_refused_when_built(kw, match):
    with pytest.raises(ValueError, match=match):
        Quantizer(**kw)


def test_mxfp4_refuses_a_global_amax():
    with pytest.raises(ValueError, match="MXFP4 has no global amax: pass global_amax=None"):
        Quantizer("mxfp4").quantize(_x(), global_amax=1.0)


def test_the_scale_rule_reaches_the_mxfp4_format():
    x = torch.zeros(2, 32)
    x[:, 0] = 7.0  # floor: e = 0 (7 saturates to 6); ceil: e = 1 (7 / 2 = 3.5 -> 4)
    assert get_format("mxfp4", "ceil").scale_rule == "ceil"
    for rule, want in (("floor", 6.0), ("ceil", 8.0)):
        q = Quantizer("mxfp4", scale_rule=rule).quantize(x)
        assert torch.equal(q.block_scales.view(torch.uint8), mxfp4.quantize(x, scale_rule=rule).block_scales.view(
            torch.uint8))
        assert fake_quantize(x, "mxfp4", scale_rule=rule)[:, 0].tolist() == [want, want]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quantizer", [Quantizer("nvfp4", per_row=True), Quantizer("mxfp4"), kv.SGLangKVQuantizer()],
                         ids=["nvfp4", "mxfp4", "sglang_kvfp4"])
def test_fake_quantize_returns_the_input_dtype(quantizer, dtype):
    x = _x(k=32, dtype=dtype)
    y = quantizer.fake_quantize(x)
    assert y.dtype == dtype and torch.equal(y, quantizer.quantize(x).dequantize(dtype))


def _own_mask(x, q, block):
    """|x / s| <= 6 elementwise, s the dequantized scale of the element's block (a power of two for E8M0)."""
    s = torch.exp2(q.block_scales.view(torch.uint8).float() - 127).repeat_interleave(block, -1)[..., : x.shape[-1]]
    return (x / s).abs() <= 6


@pytest.mark.parametrize("k", [40, 64])
def test_mxfp4_clip_mask_and_ste_gradient(k):
    x = _x(k)
    rec = mxfp4.quantize(x / 1.5).guidance(compact=True)  # the rollout's scales too small: some |z| > 6
    qz = Quantizer("mxfp4", ste_clip=True)
    q, inside = qz.quantize_with_clip_mask(x, guidance=rec)
    want = _own_mask(x, q, 32)
    assert torch.equal(inside, want) and not want.all() and want.any()
    xg = x.clone().requires_grad_()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    (qz.fake_quantize(xg, guidance=rec) * w).sum().backward()
    assert torch.equal(xg.grad, w * want)


def test_sglang_kv_clip_mask():
    x = _x(64)
    rec = kv.quantize(x / 1.5, compute_dtype=torch.float32).guidance(compact=False)
    qz = kv.SGLangKVQuantizer(ste_clip=True)
    q, inside = qz.quantize_with_clip_mask(x, guidance=rec)
    want = _own_mask(x, q, 16)
    assert torch.equal(inside, want) and not want.all() and want.any()
    # its own (ceil) scales leave |z| <= 6 except where float32 log2 rounds the exponent down
    edge = torch.zeros(1, 16)
    edge[0, 0] = float(torch.tensor(96.0).nextafter(torch.tensor(200.0)).nextafter(torch.tensor(200.0)))
    q, inside = qz.quantize_with_clip_mask(edge)
    assert torch.equal(inside, _own_mask(edge, q, 16)) and inside.tolist() == [[False] + [True] * 15]


def test_sglang_kv_quantizer_computes_in_float32():
    # SGLang's compiled quantizer (inductor: float32 math), also for a bf16 cache, where eager bf16 math differs
    x = (torch.randn(2000, 64, generator=torch.Generator().manual_seed(0)) * 30).to(torch.bfloat16)
    q = kv.SGLangKVQuantizer().quantize(x)
    f32 = kv.quantize(x, compute_dtype=torch.float32)
    assert torch.equal(q.codes, f32.codes) and torch.equal(q.block_scales.view(torch.uint8),
                                                           f32.block_scales.view(torch.uint8))
    assert not torch.equal(kv.quantize(x).block_scales.view(torch.uint8), f32.block_scales.view(torch.uint8))
    with pytest.raises(ValueError, match="sglang_kvfp4 has no global amax: pass global_amax=None"):
        kv.SGLangKVQuantizer().fake_quantize(x, global_amax=1.0)


def test_nvfp4_fake_quantize_keeps_per_row():
    x = _x(32)
    assert torch.equal(fake_quantize(x, per_row=True), nvfp4.quantize(x, per_row=True).dequantize())
    assert not torch.equal(fake_quantize(x, per_row=True), fake_quantize(x))
