"""The shared W4A4 experts function: packed == dequantized weights, == the hf backend's experts forward."""

import pytest
import torch

from megatron_trace.rollout.fp4_moe import PackedExperts, w4a4_experts_forward

from ._common import CFG, E, tiny_experts, tiny_inputs


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


def test_packed_experts_reject_dtypes_amax_and_widths_that_do_not_fit_the_format():
    """Codes that are not uint8, block scales of another dtype (raw bytes, the other format's), an NVFP4 payload
    without its global amax (or an MXFP4 one with one), an amax that is not float32 or of another shape, codes wider
    than k: each refused by name, where it would otherwise dequantize to other values (a uint8 scale byte read as
    its integer value) or fail far away; and ``stack`` refuses experts of two formats."""
    from megatron_trace.formats import mxfp4

    p = _packed(tiny_experts()[0])
    fields = dict(codes=p.codes, block_scales=p.block_scales, global_amax=p.global_amax, k=p.k)
    for change, match in [
        (dict(codes=p.codes.view(torch.int8)), r"codes must be uint8 \[E, N, K/2\], got torch.int8"),
        (dict(codes=torch.cat([p.codes, p.codes[..., :8]], -1)), r"codes shape \(4, 32, 24\) do not fit"),
        (dict(block_scales=p.block_scales.view(torch.uint8)), r"scales dtype torch.uint8 is not torch.float8_e4m3fn"),
        (dict(block_scales=p.block_scales.view(torch.float8_e8m0fnu)), r"block_scales dtype torch.float8_e8m0fnu"),
        (dict(global_amax=None), r"global_amax is None: fmt='nvfp4' needs a float32"),
        (dict(global_amax=p.global_amax.bfloat16()), r"global_amax dtype torch.bfloat16 is not torch.float32"),
        (dict(global_amax=p.global_amax[:1]), r"global_amax shape \(1,\) must be \(4,\) or \(4, 32\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            PackedExperts(**{**fields, **change})
    mx = PackedExperts.stack([mxfp4.quantize(w) for w in tiny_experts()[0]])
    assert mx.global_amax is None and mx.fmt == "mxfp4"
    with pytest.raises(ValueError, match=r"global_amax must be None for fmt='mxfp4'"):
        PackedExperts(codes=mx.codes, block_scales=mx.block_scales, global_amax=p.global_amax, k=mx.k, fmt="mxfp4")
    w = tiny_experts()[0]
    with pytest.raises(ValueError, match=r"experts \[1\] differ in shape/format"):
        PackedExperts.stack([CFG.weight_quantizer().quantize(w[0]), mxfp4.quantize(w[1])])
    from megatron_trace.formats import nvfp4

    with pytest.raises(ValueError, match=r"amaxes have shapes \['\(\)', '\(32, 1\)'\]: .*all per-tensor or all"):
        PackedExperts.stack([nvfp4.quantize(w[0]), nvfp4.quantize(w[1], per_row=True)])


def test_expert_ids_and_quantizer_are_checked_and_dense_weights_give_an_empty_output_too():
    fc1, fc2 = tiny_experts()
    hidden, ids, w = tiny_inputs()
    aq = CFG.activation_quantizer()
    for bad in (E, -1):
        with pytest.raises(ValueError, match=rf"expert ids outside \[0, {E}\)"):
            w4a4_experts_forward(hidden, ids.clone().fill_(bad), w, fc1, fc2, activation_quantizer=aq)
    with pytest.raises(ValueError, match="quantize_fc1/quantize_fc2 need an activation_quantizer"):
        w4a4_experts_forward(hidden, ids, w, fc1, fc2, activation_quantizer=None, quantize_fc1=False)
    res = w4a4_experts_forward(hidden[:0], ids[:0], w[:0], fc1, fc2, activation_quantizer=aq)
    assert res.out.shape == (0, hidden.shape[1])
