"""``rollout.experts``: the hf backend's experts forward quantizes exactly the sites its ``RolloutNumerics`` asks for
(each of fc1 / fc2 on its own, none in a layer ``exclude_modules`` keeps in BF16), equal to ``w4a4_experts_forward``
with those flags; and ``ExpertWeightStore.stacked`` stacks experts 0..E-1 only."""

import dataclasses

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.rollout.experts import ExpertWeightStore, RolloutNumerics, active_numerics, rollout_experts_forward
from megatron_trace.rollout.fp4_moe import w4a4_experts_forward
from megatron_trace.rollout.recorder import GuidanceRecorder

CFG = TraceConfig()


def _experts(seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    g = torch.Generator().manual_seed(seed)
    m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4,
                                       num_experts_per_tok=2))
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) / 4)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) / 4)
    hidden = torch.randn(5, 32, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    return m, hidden, ids, torch.rand(5, 2, generator=g)


@pytest.mark.parametrize("fc1, fc2", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("excluded", [False, True])
def test_the_experts_forward_quantizes_the_sites_asked_for_and_none_of_an_excluded_layer(fc1, fc2, excluded):
    m, hidden, ids, w = _experts()
    rec = GuidanceRecorder(1, {(0, "expert_fc1_in"), (0, "expert_fc2_in")}, compact=False)
    num = RolloutNumerics(layer_of={id(m): 0}, activation_quantizer=CFG.activation_quantizer(), quantize_fc1=fc1,
                          quantize_fc2=fc2, recorder=rec, bf16_layers=frozenset({0} if excluded else ()))
    with torch.no_grad(), active_numerics(num):
        got = rollout_experts_forward(m, hidden, ids, w)
        want = w4a4_experts_forward(hidden, ids, w, m.gate_up_proj, m.down_proj,
                                    activation_quantizer=CFG.activation_quantizer(), quantize_fc1=fc1 and not excluded,
                                    quantize_fc2=fc2 and not excluded)
    assert torch.equal(got, want.out)
    recorded = {site for (_, site), chunks in rec._records.items() if chunks}
    assert recorded == {s for s, on in (("expert_fc1_in", fc1), ("expert_fc2_in", fc2)) if on and not excluded}


def test_stacked_needs_every_expert_from_0():
    """A layer whose FP4 weights lack an expert (here 2 of 0..3) is refused, not stacked as 3 experts with expert
    3's weights at index 2."""
    m, *_ = _experts()
    store = ExpertWeightStore(CFG.weight_quantizer())
    for e in (0, 1, 3):
        store.quantize_from_params(m, 0, e, "fc1")
    with pytest.raises(KeyError, match=r"FP4 weights of experts \[0, 1, 3\] are not 0..E-1"):
        store.stacked(0, "fc1")
    store.quantize_from_params(m, 0, 2, "fc1")
    assert torch.equal(store.stacked(0, "fc1").codes[3], store.get(0, 3, "fc1").codes)


def test_a_weight_of_another_format_is_refused_before_anything_changes():
    """An MXFP4 matrix set into an NVFP4 store would dequantize right in the parameter but be stacked (the grouped
    GEMM's [E, N, K]) under expert 0's format: its E8M0 scales read as E4M3. Refused by name, nothing changed."""
    from megatron_trace.formats import mxfp4

    m, *_ = _experts()
    store = ExpertWeightStore(CFG.weight_quantizer())
    before = m.gate_up_proj.detach().clone()
    with pytest.raises(ValueError, match="FP4 weight format 'mxfp4' != the rollout's weight format 'nvfp4'"):
        store.set(m, 0, 1, "fc1", mxfp4.quantize(m.gate_up_proj[1].detach()))
    assert len(store) == 0 and torch.equal(m.gate_up_proj, before)


def test_an_infinite_amax_is_refused_and_the_bytes_count_codes_scales_and_amax():
    from megatron_trace.formats import FP4Tensor, NonFiniteError

    m, *_ = _experts()
    store = ExpertWeightStore(CFG.weight_quantizer())
    for e in range(4):
        store.quantize_from_params(m, 0, e, "fc1")
        store.quantize_from_params(m, 0, e, "fc2")
    per_matrix = [n * k // 2 + n * k // 16 + 4 for n, k in (m.gate_up_proj.shape[1:], m.down_proj.shape[1:])]
    assert store.nbytes() == 4 * sum(per_matrix)  # packed E2M1 + E4M3 block scales + an fp32 amax, per matrix
    q = store.get(0, 1, "fc2")
    bad = FP4Tensor(codes=q.codes, block_scales=q.block_scales, global_amax=torch.tensor(float("inf")),
                    shape=q.shape, fmt=q.fmt)
    with pytest.raises(NonFiniteError, match="layer 0 expert 1 fc2: its global amax hold NaN/Inf"):
        store.set(m, 0, 1, "fc2", bad)


def test_a_weight_whose_codes_or_scales_have_another_dtype_is_refused():
    """Block scales as raw bytes (uint8) or codes as int8 (a sender's or a wire layout's slip) would dequantize to
    other values in the parameter: refused by name, nothing changed."""
    m, *_ = _experts()
    store = ExpertWeightStore(CFG.weight_quantizer())
    q = CFG.weight_quantizer().quantize(m.down_proj[0].detach())
    before = m.down_proj.detach().clone()
    for bad in (dataclasses.replace(q, block_scales=q.block_scales.view(torch.uint8)),
                dataclasses.replace(q, codes=q.codes.view(torch.int8))):
        with pytest.raises(ValueError, match="expert 0 fc2 has codes .* needs torch.uint8 and torch.float8_e4m3fn"):
            store.set(m, 0, 0, "fc2", bad)
    assert len(store) == 0 and torch.equal(m.down_proj, before)
    store.set(m, 0, 0, "fc2", q)
    assert torch.equal(m.down_proj[0], q.dequantize(m.down_proj.dtype))
