"""Guidance bytes: encode/decode round trip, capture -> payloads -> SiteGuidance."""

import pytest
import torch

from megatron_trace.formats import nvfp4
from megatron_trace.rollout.sglang.capture import GuidanceCapture
from megatron_trace.rollout.sglang.records import SiteSpec, assemble, decode_rows, encode_rows


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full"])
def test_encode_decode_round_trip(compact):
    q = nvfp4.quantize(torch.randn(6, 2, 40), per_row=True)  # K=40 pads to 48
    spec = SiteSpec(3, "expert_fc2_in", (2, 40), compact=compact)
    rec = decode_rows(encode_rows(q, spec), spec)
    want = q.guidance(compact=compact)
    payload = "mantissa_bits" if compact else "codes"
    assert torch.equal(getattr(rec, payload), getattr(want, payload))
    assert torch.equal(rec.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    assert torch.equal(rec.global_amax, want.global_amax) and rec.shape == want.shape


def test_rejects_wrong_rows():
    spec = SiteSpec(0, "expert_fc1_in", (32,))
    with pytest.raises(ValueError, match="do not match the spec"):
        encode_rows(nvfp4.quantize(torch.randn(3, 16), per_row=True), spec)


def test_capture_payloads_assemble_into_site_guidance():
    spec1 = SiteSpec(1, "expert_fc1_in", (32,), compact=True)
    spec2 = SiteSpec(1, "expert_fc2_in", (2, 16), compact=False)
    cap = GuidanceCapture([spec1, spec2])
    steps = [[], []]
    # prefill: request 0 has 3 prompt tokens, request 1 has 2 (its first token came from the prefix cache)
    x = torch.randn(5, 32)
    a = torch.randn(5, 2, 16)
    cap.record(1, "expert_fc1_in", nvfp4.quantize(x, per_row=True))
    cap.record(1, "expert_fc2_in", nvfp4.quantize(a, per_row=True))
    cap.record(0, "expert_fc1_in", nvfp4.quantize(x, per_row=True))  # not selected: ignored
    for i, p in enumerate(cap.payloads(starts=[0, 1], counts=[3, 2])):
        steps[i].append(p)
    # one decode step each
    x2, a2 = torch.randn(2, 32), torch.randn(2, 2, 16)
    cap.record(1, "expert_fc1_in", nvfp4.quantize(x2, per_row=True))
    cap.record(1, "expert_fc2_in", nvfp4.quantize(a2, per_row=True))
    for i, p in enumerate(cap.payloads(starts=[3, 3], counts=[1, 1])):
        steps[i].append(p)
    routing = {1: torch.randint(0, 4, (2, 5, 2))}
    g = assemble(steps, [spec1, spec2], seq_len=5, routing=routing)
    fc1 = g[(1, "expert_fc1_in")]
    assert fc1.valid.tolist() == [[True, True, True, True, False], [False, True, True, True, False]]
    want = nvfp4.quantize(torch.cat([x[:3], x2[:1]]), per_row=True).guidance(compact=True)
    assert torch.equal(fc1.record.mantissa_bits[0, :4], want.mantissa_bits)
    assert torch.equal(fc1.record.global_amax[1, 1:3], nvfp4.quantize(x[3:], per_row=True).global_amax)
    fc2 = g[(1, "expert_fc2_in")]
    assert fc2.valid.shape == (2, 5, 2) and torch.equal(fc2.expert_ids, routing[1])
    assert torch.equal(fc2.record.codes[1, 3], nvfp4.quantize(a2[1:], per_row=True).codes[0])
    with pytest.raises(ValueError, match="routing"):
        assemble(steps, [spec2], seq_len=5)
