"""KV-cache site: K and V fake-quantized per token per KV head (blocks along head_dim) before Megatron's attention."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_trace.config import TraceConfig
from megatron_trace.formats import Quantizer
from megatron_trace.guidance.site import FallbackCounter, SiteGuidance
from megatron_trace.megatron import TraceDotProductAttention
from megatron_trace.megatron.attention import KVStep
from megatron_trace.megatron.step import CheckedSite, StepState

from .harness import tiny_config

pytestmark = pytest.mark.usefixtures("world1")

S, B, HEADS, GROUPS, HD = 8, 2, 4, 2, 32
MASK = torch.tril(torch.ones(1, 1, S, S, dtype=torch.bool)).logical_not()  # True = masked out


def _pair(tc):
    cfg = tiny_config(kv_channels=HD)
    kw = dict(config=cfg, layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**kw), TraceDotProductAttention(**kw, trace_config=tc)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, HEADS, HD, generator=g).bfloat16()
    k = torch.randn(S, B, GROUPS, HD, generator=g).bfloat16()
    v = torch.randn(S, B, GROUPS, HD, generator=g).bfloat16()
    return q, k, v


def test_kv_quantized_per_token_per_kv_head():
    stock, trace = _pair(TraceConfig())
    q, k, v = _qkv()
    k[:, :, 1] *= 100  # a loud KV head must not change the other head's scales
    fq = Quantizer("nvfp4", per_row=True)
    with torch.no_grad():
        want = stock(q, fq.quantize(k).dequantize(k.dtype), fq.quantize(v).dequantize(v.dtype), MASK)
        got = trace(q, k, v, MASK)
    assert torch.equal(got, want)
    head0 = fq.quantize(k[:, :, :1]).dequantize(k.dtype)  # head 0 alone
    assert torch.equal(trace.quantize_kv("kv_k", k)[:, :, :1], head0)
    assert fq.quantize(k).block_scales.shape == (S, B, GROUPS, HD // 16)  # 16-element blocks along head_dim


def test_only_the_configured_sites_are_quantized():
    stock, trace = _pair(TraceConfig(sites=("kv_v",), guided_sites=("kv_v",)))
    q, k, v = _qkv(1)
    fq = Quantizer("nvfp4", per_row=True)
    with torch.no_grad():
        assert torch.equal(trace(q, k, v, MASK), stock(q, k, fq.quantize(v).dequantize(v.dtype), MASK))


def test_kv_guidance_takes_this_ranks_heads():
    """Tensor parallelism splits KV heads: rank 1 of 2 uses heads 2..3 of the batch-major record."""
    tc = TraceConfig(guided_layers="all")
    g = torch.Generator().manual_seed(2)
    full = torch.randn(B, S, 4, HD, generator=g)  # [B, S, kv_heads=4, hd]
    rec = Quantizer("nvfp4", per_row=True).quantize(full).guidance(compact=True)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, 3] = False
    state = StepState(config=tc, counter=FallbackCounter(), fallback="rne", guided_layers=frozenset({0}))
    step = KVStep(state, 0, {"kv_k": CheckedSite(SiteGuidance(rec, valid), MASK)}, first_head=2)
    local = full[:, :, 2:].transpose(0, 1).contiguous()  # this rank's K [S, B, 2, hd]
    rows = step.rows("kv_k", local)
    assert rows.record.shape == (S * B * 2, HD)
    want = Quantizer("nvfp4", per_row=True).quantize(local.reshape(-1, HD)).guidance(compact=True)
    assert torch.equal(rows.record.mantissa_bits, want.mantissa_bits)
    assert torch.equal(rows.record.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    assert torch.equal(rows.record.global_amax, want.global_amax)
    assert int((~rows.valid).sum()) == 2  # token (b=1, s=3): both of its local heads
    state.resolve()  # counts are deferred device tensors until resolved (once per step)
    assert state.counter.used == S * B - 1 and dict(state.counter.fallback) == {"invalid_row": 1}


class _Group:
    """A tensor-parallel group's rank and size (what ``kv_heads`` asks of it)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("groups, tp", [(2, 4), (1, 4), (4, 2), (8, 4), (2, 2)])
def test_kv_heads_are_the_heads_of_the_rank_s_query_heads(groups, tp):
    """Under TP, rank r holds query heads r * H / TP .. (r + 1) * H / TP - 1 (Megatron splits them evenly); its first
    KV head is the group of its first query head, h * G // H (with G < TP a KV head serves TP / G ranks)."""
    _, trace = _pair(TraceConfig())
    heads = 8  # query heads of the model
    trace.trace_kv_groups = groups
    for r in range(tp):
        trace.tp_group = _Group(r, tp)
        first_query = r * heads // tp
        assert trace.kv_heads() == (groups, first_query * groups // heads), (r, tp, groups)


@pytest.mark.parametrize("fallback", ["rne", "fail"])
def test_kv_records_of_another_batch_shape_fall_back_or_raise_with_fail(fallback):
    """Records [B, S - 1] for a [S, B] K: counted ``shape`` and left to the trainer's own rounding, or raised under
    ``fallback='fail'`` (naming both shapes)."""
    from megatron_trace.megatron.step import GuidanceFallbackError

    tc = TraceConfig(guided_layers="all")
    g = torch.Generator().manual_seed(4)
    rec = Quantizer("nvfp4", per_row=True).quantize(torch.randn(B, S - 1, GROUPS, HD, generator=g)).guidance(
        compact=True)
    state = StepState(config=tc, counter=FallbackCounter(), fallback=fallback, guided_layers=frozenset({0}))
    step = KVStep(state, 0, {"kv_k": CheckedSite(SiteGuidance(rec, torch.ones(B, S - 1, dtype=torch.bool)), None)},
                  first_head=0)
    k = torch.randn(S, B, GROUPS, HD, generator=g)
    if fallback == "fail":
        with pytest.raises(GuidanceFallbackError, match=rf"layer 0 kv_k: guidance rows \({B}, {S - 1}\) != "
                                                         rf"\[B, S\]=\({B}, {S}\)"):
            step.rows("kv_k", k)
        return
    assert step.rows("kv_k", k) is None
    state.resolve()
    assert state.counter.used == 0 and dict(state.counter.fallback) == {"shape": S * B}


@pytest.mark.parametrize("qkv_format", [None, "sbhd"])
def test_packed_kv_under_guidance_is_refused_naming_its_shape(qkv_format):
    """K of packed sequences ([T, heads, head_dim], no batch dimension) under trace_guidance without
    ``packed_seq_params.qkv_format="thd"`` (then taken as [T, 1, heads, head_dim]: test_packing.py): refused, not
    read as [S=T, B=heads, g=head_dim] rows and counted as a fallback."""
    tc = TraceConfig(guided_layers="all")
    _, trace = _pair(tc)
    state = StepState(config=tc, counter=FallbackCounter(), fallback="rne", guided_layers=frozenset({1}))
    trace._trace_step = KVStep(state, 1, {"kv_k": CheckedSite(None, "missing")}, first_head=0)
    k = torch.randn(S * B, GROUPS, HD).bfloat16()
    params = None if qkv_format is None else PackedSeqParams(qkv_format=qkv_format)
    with pytest.raises(ValueError, match=r"\[S, B, heads, head_dim\], or \[T, heads, head_dim\] with packed_seq_params"
                                         rf".qkv_format='thd', got \(16, 2, 32\) with qkv_format={qkv_format!r}"):
        trace.quantize_kv("kv_k", k, params)


def test_a_step_held_twice_releases_back_to_its_host_records():
    """``hold`` of a step already held keeps it (a recompute's second hold): ``release`` then gives the host records
    back, not the device copies of the first hold."""
    tc = TraceConfig(guided_layers="all")
    rec = Quantizer("nvfp4", per_row=True).quantize(torch.randn(B, S, GROUPS, HD)).guidance(compact=True)
    host = {"kv_k": CheckedSite(SiteGuidance(rec, torch.ones(B, S, dtype=torch.bool)), None)}
    step = KVStep(StepState(config=tc, counter=FallbackCounter(), fallback="rne", guided_layers=frozenset({0})), 0,
                  host, first_head=0)
    step.hold("meta")
    held = step.sites
    assert held["kv_k"].sg.valid.is_meta
    step.hold("meta")
    assert step.sites is held
    step.release()
    assert step.sites is host
