"""The shared W4A4 experts function: packed == dequantized weights, == the hf backend's experts forward."""

import pytest
import torch

from megatron_trace.rollout.fp4_moe import PackedExperts, w4a4_experts_forward

from ._common import CFG, tiny_experts, tiny_inputs


def _packed(w):
    q = CFG.weight_quantizer()
    return PackedExperts.stack([q.quantize(w[e]) for e in range(w.shape[0])])


def test_packed_equals_dequantized_weights():
    fc1, fc2 = tiny_experts()
    p1, p2 = _packed(fc1), _packed(fc2)
    d1 = torch.stack([CFG.weight_quantizer().fake_quantize(w) for w in fc1])
    d2 = torch.stack([CFG.weight_quantizer().fake_quantize(w) for w in fc2])
    hidden, ids, w = tiny_inputs()
    aq = CFG.activation_quantizer()
    a = w4a4_experts_forward(hidden, ids, w, p1, p2, activation_quantizer=aq)
    b = w4a4_experts_forward(hidden, ids, w, d1, d2, activation_quantizer=aq)
    assert torch.equal(a.out, b.out)
    assert torch.equal(a.fc1_in.codes, b.fc1_in.codes) and a.fc2_in.shape == (hidden.shape[0], ids.shape[1], 16)


def test_matches_hf_backend_experts_forward():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from megatron_trace.rollout.experts import RolloutNumerics, active_numerics, rollout_experts_forward
    from megatron_trace.rollout.recorder import GuidanceRecorder

    fc1, fc2 = tiny_experts()
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    m = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    q = CFG.weight_quantizer()
    with torch.no_grad():
        for e in range(4):
            m.gate_up_proj[e].copy_(q.quantize(fc1[e]).dequantize(torch.bfloat16))
            m.down_proj[e].copy_(q.quantize(fc2[e]).dequantize(torch.bfloat16))
    hidden, ids, w = tiny_inputs()
    rec = GuidanceRecorder(1, {(0, "expert_fc1_in"), (0, "expert_fc2_in")}, compact=False)
    num = RolloutNumerics(layer_of={id(m): 0}, activation_quantizer=CFG.activation_quantizer(),
                          quantize_fc1=True, quantize_fc2=True, recorder=rec)
    with torch.no_grad(), active_numerics(num):
        ref = rollout_experts_forward(m, hidden, ids, w)
    ours = w4a4_experts_forward(hidden, ids, w, _packed(fc1), _packed(fc2),
                                activation_quantizer=CFG.activation_quantizer())
    assert torch.equal(ours.out, ref)
    (fc1_rec,) = rec._records[(0, "expert_fc1_in")]
    assert torch.equal(fc1_rec.codes[0], ours.fc1_in.codes)


def test_no_tokens_give_an_empty_output():
    """An idle rank (no tokens routed to this batch) gets [0, H] and empty activation rows, not a view error."""
    fc1, fc2 = tiny_experts()
    hidden, ids, w = tiny_inputs()
    for q_fc1, q_fc2 in ((True, True), (False, False)):
        res = w4a4_experts_forward(hidden[:0], ids[:0], w[:0], _packed(fc1), _packed(fc2),
                                   activation_quantizer=CFG.activation_quantizer(), quantize_fc1=q_fc1,
                                   quantize_fc2=q_fc2)
        assert res.out.shape == (0, hidden.shape[1]) and res.out.dtype == hidden.dtype
        assert res.fc2_in is None if not q_fc2 else res.fc2_in.shape == (0, ids.shape[1], fc2.shape[2])


def test_packed_experts_reject_payloads_that_do_not_fit_k():
    p = _packed(tiny_experts()[0])  # codes [E, 2F, H/2], scales [E, 2F, H/16]
    with pytest.raises(ValueError, match=r"PackedExperts.codes must be uint8 \[E, N, K/2\], got torch.uint8 \(16,\)"):
        PackedExperts(codes=p.codes[0, 0], block_scales=p.block_scales, global_amax=p.global_amax, k=p.k)
    with pytest.raises(ValueError, match=r"do not fit \(E, N\) = \(4, 32\) and k=8 \(1 blocks of 16"):
        PackedExperts(codes=p.codes, block_scales=p.block_scales, global_amax=p.global_amax, k=8)
    with pytest.raises(ValueError, match="block_scales shape"):
        PackedExperts(codes=p.codes, block_scales=p.block_scales[..., :1], global_amax=p.global_amax, k=p.k)


def test_equals_a_per_token_loop_written_out():
    """Independent reference: for each token t and slot j, ``w[t, j] * fc2[e] @ (silu(gate) * up)`` with
    ``[gate; up] = fc1[e] @ x[t]``, e = ids[t, j]; the expert_fc2_in rows are (token, slot) ordered."""
    fc1, fc2 = (w.float() for w in tiny_experts())
    hidden, ids, w = tiny_inputs()
    hidden = hidden.float()
    aq = CFG.activation_quantizer()
    ffn = fc2.shape[-1]
    act = torch.zeros(*ids.shape, ffn)
    want = torch.zeros_like(hidden)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = fc1[e] @ hidden[t]
            act[t, j] = torch.nn.functional.silu(h[:ffn]) * h[ffn:]
            want[t] += w[t, j] * (fc2[e] @ act[t, j])
    got = w4a4_experts_forward(hidden, ids, w, fc1, fc2, activation_quantizer=None, quantize_fc1=False,
                               quantize_fc2=False)
    torch.testing.assert_close(got.out, want, rtol=1e-5, atol=1e-6)
    rows = w4a4_experts_forward(hidden, ids, w, fc1, fc2, activation_quantizer=aq, quantize_fc1=False).fc2_in
    assert torch.equal(rows.codes, aq.quantize(act).codes)  # per-row scales: row (t, j) is act[t, j]'s


@pytest.mark.parametrize("n", [32, 4])  # (n = 4: as many rows as blocks per row, where a misplaced amax broadcasts)
def test_packed_experts_with_a_per_row_amax_give_each_experts_matrix(n):
    """``PackedExperts`` of per-row-amax weights (global_amax [E, N]): expert e is that expert's FP4Tensor, value for
    value (its amax [N, 1] on its rows)."""
    from megatron_trace.formats import nvfp4

    g = torch.Generator().manual_seed(3)
    qs = [nvfp4.quantize(torch.randn(n, 64, generator=g) * (e + 1), per_row=True) for e in range(3)]
    packed = PackedExperts.stack(qs)
    assert tuple(packed.global_amax.shape) == (3, n)
    for e, q in enumerate(qs):
        assert torch.equal(packed.expert(e).dequantize(torch.float32), q.dequantize(torch.float32))
