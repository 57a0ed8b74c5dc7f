"""The rollout's FP4 expert weights in the CUDA GEMM's layout (``ExpertWeightStore.packed``): the packed copy of the
stacked weights, cached until a weight of that layer changes, None where the shape has no packed layout."""

import torch

from megatron_trace.config import TraceConfig
from megatron_trace.kernels import moe_mma
from megatron_trace.rollout.experts import ExpertWeightStore


class _Experts(torch.nn.Module):
    def __init__(self, e, h, ffn, gen):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * ffn, h, generator=gen) * h**-0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(e, h, ffn, generator=gen) * ffn**-0.5)


def _store(e=4, h=256, ffn=128, seed=0):
    m = _Experts(e, h, ffn, torch.Generator().manual_seed(seed))
    store = ExpertWeightStore(TraceConfig().weight_quantizer())
    for ex in range(e):
        store.quantize_from_params(m, 0, ex, "fc1")
        store.quantize_from_params(m, 0, ex, "fc2")
    return m, store


def test_packed_is_the_stacked_weight_packed_and_cached_until_a_set():
    m, store = _store()
    p = store.packed(0, "fc1")
    assert p is store.packed(0, "fc1")
    back = moe_mma.unpack(p)
    stacked = store.stacked(0, "fc1")
    assert torch.equal(back.codes, stacked.codes) and torch.equal(back.global_amax, stacked.global_amax)
    assert torch.equal(back.block_scales.view(torch.uint8), stacked.block_scales.view(torch.uint8))
    fc2 = store.packed(0, "fc2")
    with torch.no_grad():
        m.gate_up_proj[2] *= 2
    store.quantize_from_params(m, 0, 2, "fc1")
    fresh = store.packed(0, "fc1")
    assert fresh is not p and store.packed(0, "fc2") is fc2
    assert torch.equal(moe_mma.unpack(fresh).codes[2], store.get(0, 2, "fc1").codes)


def test_packed_is_none_where_the_shape_has_no_packed_layout():
    _, store = _store(h=192, ffn=256)
    assert store.packed(0, "fc1") is None  # K = 192: not a multiple of 256
    assert store.packed(0, "fc2") is not None  # N = 192, K = 256


def test_the_prefill_layout_is_cached_beside_the_decode_one_and_dropped_on_a_set():
    from megatron_trace.kernels import moe_wgmma

    m, store = _store(e=2, h=256, ffn=128)
    w = store.packed(0, "fc1", "wgmma")
    assert w.layout == "wgmma" and w is store.packed(0, "fc1", "wgmma") and store.packed(0, "fc1").layout == "mma"
    back = moe_wgmma.unpack(w)
    assert torch.equal(back.codes, store.stacked(0, "fc1").codes)
    store.quantize_from_params(m, 0, 1, "fc1")
    assert store.packed(0, "fc1", "wgmma") is not w
    _, small = _store(e=2, h=256, ffn=64)
    assert small.packed(0, "fc2", "wgmma") is None  # K = 64
    assert small.packed(0, "fc1", "wgmma") is not None  # N = 128, K = 256
    import pytest

    with pytest.raises(ValueError, match="layout='cutlass' is not one of"):
        store.packed(0, "fc1", "cutlass")


def test_prefill_sized_calls_take_the_wgmma_layout_only_when_asked(monkeypatch):
    from megatron_trace.kernels import moe_wgmma
    from megatron_trace.rollout import experts

    _, store = _store(e=4, h=256, ffn=256)
    fc1 = store.stacked(0, "fc1")
    assert experts._packed_layout(4 * 128, fc1, store, 0) == "mma"  # (PREFILL_WGMMA off by default)
    monkeypatch.setattr(experts, "PREFILL_WGMMA", True)
    assert experts._packed_layout(4 * 64, fc1, store, 0) == "wgmma"
    assert experts._packed_layout(4 * 64 - 1, fc1, store, 0) == "mma"
    monkeypatch.setattr(moe_mma, "AUTO", False)
    assert experts._packed_layout(64, fc1, store, 0) is None
    monkeypatch.setattr(moe_wgmma, "AUTO", False)
    assert experts._packed_layout(4 * 128, fc1, store, 0) is None


def test_prefill_sized_calls_read_the_dequantized_weights(monkeypatch):
    from megatron_trace.rollout import experts

    start = experts.DENSE_FROM
    assert experts._dense_gemms(start * 16, 16) and not experts._dense_gemms(start * 16 - 1, 16)
    monkeypatch.setattr(experts, "PREFILL_WGMMA", True)  # (the wgmma GEMM keeps the sizes where it is faster)
    start = experts.DENSE_FROM_WGMMA
    assert start > experts.DENSE_FROM
    assert experts._dense_gemms(start * 16, 16) and not experts._dense_gemms(start * 16 - 1, 16)
    monkeypatch.setattr(experts, "DENSE_FROM_WGMMA", None)
    assert not experts._dense_gemms(10**9, 16)


def test_stacked_is_the_current_weights_after_a_set():
    """After a set of one expert, ``stacked`` (the grouped GEMM's [E, N, K]) holds that expert's new codes, scales
    and amax (a change that is not a rescale: new codes, not only a new amax) and the others' as before."""
    m, store = _store()
    before = store.stacked(0, "fc1")
    with torch.no_grad():
        m.gate_up_proj[2] += torch.randn(m.gate_up_proj[2].shape, generator=torch.Generator().manual_seed(5))
    want = TraceConfig().weight_quantizer().quantize(m.gate_up_proj[2].detach().clone())
    store.quantize_from_params(m, 0, 2, "fc1")
    got = store.stacked(0, "fc1")
    assert not torch.equal(want.codes, before.codes[2])
    assert torch.equal(got.codes[2], want.codes) and torch.equal(got.codes[[0, 1, 3]], before.codes[[0, 1, 3]])
    assert torch.equal(got.block_scales[2].view(torch.uint8), want.block_scales.view(torch.uint8))
    assert torch.equal(got.global_amax[2], want.global_amax.float().expand(got.shape[1], 1))
