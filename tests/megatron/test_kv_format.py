"""``TraceConfig.kv_format="sglang_kvfp4"``: the KV site computes SGLang's FP4 KV cache bit for bit (own rounding)
and SGLang-format records guide it (accepted by the format check, codes reproduced exactly)."""

import logging

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_trace.config import TraceConfig
from megatron_trace.formats import Quantizer, e2m1, sglang_kvfp4
from megatron_trace.guidance.site import SiteGuidance
from megatron_trace.megatron import StepGuidance, TraceDotProductAttention, trace_guidance, trace_spec
from megatron_trace.megatron.step import FORMAT, GuidanceFallbackError, check_site

from .harness import GROUPS, LAYERS, batch, build_model, perturb_non_experts, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")

S, B, HEADS, HD = 8, 2, 4, 32
MASK = torch.tril(torch.ones(1, 1, S, S, dtype=torch.bool)).logical_not()  # True = masked out
KV = ("kv_k", "kv_v")
SG = TraceConfig(kv_format="sglang_kvfp4", guided_layers="all")


def _pair(tc, hd=HD):
    cfg = tiny_config(kv_channels=hd)
    kw = dict(config=cfg, layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**kw), TraceDotProductAttention(**kw, trace_config=tc)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, HEADS, HD, generator=g).bfloat16()
    k = (torch.randn(S, B, 2, HD, generator=g) * torch.logspace(-3, 3, HD)).bfloat16()  # many exponents
    v = torch.randn(S, B, 2, HD, generator=g).bfloat16()
    return q, k, v


def _sglang(x):
    """SGLang's compiled quantizer (float32 math) on x, dequantized to x.dtype."""
    return sglang_kvfp4.dequantize(sglang_kvfp4.quantize(x, compute_dtype=torch.float32), x.dtype)


def test_own_rounding_is_sglangs_quantizer_bit_for_bit():
    stock, trace = _pair(SG)
    q, k, v = _qkv()
    with torch.no_grad():
        assert torch.equal(trace.quantize_kv("kv_k", k), _sglang(k))
        assert torch.equal(trace(q, k, v, MASK), stock(q, _sglang(k), _sglang(v), MASK))
        nv = Quantizer("nvfp4", per_row=True).quantize(k).dequantize(k.dtype)
    assert not torch.equal(_sglang(k), nv)  # a different format than TraceConfig.format


def test_straight_through_gradient_and_clip():
    _, trace = _pair(SG)
    _, k, _ = _qkv(1)
    k.requires_grad_(True)
    trace.quantize_kv("kv_k", k).float().pow(2).sum().backward()
    assert torch.equal(k.grad, 2 * _sglang(k.detach()))  # d/dk of sum(fq(k)^2) with d fq/dk = 1
    x = torch.randn(4, 32)
    rec = sglang_kvfp4.quantize(x / 4).guidance(compact=False)  # scales 4x too small: |z| > 6 for most
    x.requires_grad_(True)
    clip = SG.replace(ste_clip=True).kv_quantizer()
    clip.fake_quantize(x, guidance=rec).sum().backward()
    z = x.detach().unflatten(-1, (-1, 16)) / torch.exp2(rec.block_scales.view(torch.uint8).float() - 127).unsqueeze(-1)
    assert torch.equal(x.grad, (z.abs() <= 6).flatten(-2).float()) and 0 < int(x.grad.sum()) < x.numel()


def test_head_dim_must_be_a_multiple_of_16():
    with pytest.raises(ValueError, match="kv_format='sglang_kvfp4' needs kv_channels .* multiple of 16, got 24"):
        _pair(SG, hd=24)


def _record(x_bshd):
    """An independent SGLang-format record of K or V [B, S, g, hd] (SGLang run eagerly: bf16 math)."""
    return SiteGuidance(sglang_kvfp4.quantize(x_bshd).guidance(compact=False),
                        torch.ones(x_bshd.shape[:2], dtype=torch.bool))


def test_check_site_accepts_the_configured_kv_format_only(caplog):
    x = torch.randn(2, 5, 2, 16).bfloat16()
    sg = _record(x)
    kw = dict(layer=1, rows=(2, 16), compact=False)
    assert check_site(sg, site="kv_k", config=SG, fail=True, **kw).sg is not None
    assert check_site(sg, site="kv_v", config=SG, fail=True, **kw).sg.record.fmt == "sglang_kvfp4"
    nv = SiteGuidance(Quantizer("nvfp4", per_row=True).quantize(x).guidance(compact=False), sg.valid)
    with caplog.at_level(logging.WARNING):
        c = check_site(nv, site="kv_k", config=SG, fail=False, **kw)
    assert c.sg is None and c.reason == FORMAT
    assert "'nvfp4' != TraceConfig.kv_format 'sglang_kvfp4'" in caplog.text
    with pytest.raises(GuidanceFallbackError, match="sglang_kvfp4"):
        check_site(nv, site="kv_k", config=SG, fail=True, **kw)
    # the expert sites still want TraceConfig.format
    fc1 = SiteGuidance(sglang_kvfp4.quantize(torch.randn(2, 5, 64)).guidance(compact=False), sg.valid)
    assert check_site(fc1, site="expert_fc1_in", layer=1, rows=(64,), config=SG, compact=False,
                      fail=False).reason == FORMAT


def _model(tc, seed=0):
    cfg = tiny_config()
    return build_model(cfg, trace_spec(stock_spec(cfg), tc), seed=seed)


def _kv_inputs(model, data, step=None):
    """Each layer's K and V as core attention receives them, batch-major [B, S, g, hd], and the recorded step
    (full records of every site, routing)."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.decoder.layers):
        hooks.append(layer.self_attention.core_attention.register_forward_pre_hook(
            lambda m, a, i=i: seen.update({(i, "kv_k"): a[1].detach().transpose(0, 1).clone(),
                                           (i, "kv_v"): a[2].detach().transpose(0, 1).clone()})))
    tokens, pos, mask, _ = data
    try:
        with trace_guidance(model, step, record=True, compact=False) as h, torch.no_grad():
            model(tokens, pos, mask)
    finally:
        for hook in hooks:
            hook.remove()
    return seen, h


def _values(rec):
    return e2m1.decode(e2m1.unpack(rec.codes))[..., : rec.shape[-1]]


def _mismatch(a, b) -> int:
    return int((_values(a) != _values(b)).sum())


@pytest.mark.parametrize("cache_mode", ["full", "compact"])
def test_records_of_another_engine_guide_the_kv_site_exactly(cache_mode):
    """A perturbed model plays the rollout engine; its KV records come from SGLang's quantizer run on its K/V
    (eagerly: bf16 math), its expert records and routing from its own forward. Guided by them, the trainer
    reproduces every KV code and scale (0 mismatches); its own rounding does not."""
    data = batch()
    rollout = _model(SG)
    perturb_non_experts(rollout, 0.01)
    roll_kv, h_roll = _kv_inputs(rollout, data)
    roll = h_roll.recorded()
    kv_records = {key: _record(x) for key, x in roll_kv.items()}
    trainer = _model(SG.replace(cache_mode=cache_mode))
    _, own = _kv_inputs(trainer, data, StepGuidance(routing=roll.routing))
    _, h = _kv_inputs(trainer, data, StepGuidance(sites={**roll.sites, **kv_records}, routing=roll.routing))
    got, mine = h.recorded().sites, own.recorded().sites
    for key, sg in kv_records.items():
        assert got[key].record.fmt == "sglang_kvfp4"
        assert _mismatch(got[key].record, sg.record) == 0, key
        assert torch.equal(got[key].record.block_scales.view(torch.uint8), sg.record.block_scales.view(torch.uint8))
    assert sum(_mismatch(mine[k].record, kv_records[k].record) for k in kv_records) > 0
    t = data[0].numel()
    kv_used = sum(v for (layer, site, reason), v in h.stats().items() if site in KV and reason == "used")
    assert kv_used == LAYERS * 2 * t and not h.counter.fallback and h.coverage() == 1.0
    assert tuple(kv_records[(0, "kv_k")].record.shape[2:]) == (GROUPS, 16)


def test_own_rounding_in_the_model_equals_sglang_on_the_same_kv():
    """The trainer's recorded KV codes equal SGLang's compiled quantizer on the very K/V it saw."""
    seen, h = _kv_inputs(_model(SG), batch())
    for key, x in seen.items():
        want = sglang_kvfp4.quantize(x, compute_dtype=torch.float32)
        got = h.recorded().sites[key].record
        assert torch.equal(got.codes, want.codes), key
        assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8)), key
