"""The MoE step's row plumbing (``megatron/moe_step.py``): virtual tokens, per-token counting under a token mask,
formats that ignore the per-tensor amax."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.site import SiteGuidance
from megatron_trace.megatron import StepGuidance, trace_guidance, trace_record, trace_spec
from megatron_trace.megatron.moe_step import _virtual_experts, _virtual_token_ids
from megatron_trace.megatron.rows import payload_of

from .harness import TOPK, batch, build_model, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")


def test_virtual_tokens_are_the_routing_maps_nonzero():
    """Without the host sync: the (token, expert) pairs of ``routing_map.nonzero()``, token-major, experts
    ascending within a token, for maps of random dropless top-k routing."""
    g = torch.Generator().manual_seed(3)
    for tokens, experts, k in ((1, 4, 1), (7, 8, 2), (13, 6, 3), (5, 4, 4)):
        pick = torch.rand(tokens, experts, generator=g).argsort(1)[:, :k]
        rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, pick, True)
        t, e = rmap.nonzero().unbind(1)
        assert torch.equal(_virtual_token_ids(tokens, k, "cpu"), t)
        assert torch.equal(_virtual_experts(rmap, k), e)


def _model(tc):
    cfg = tiny_config()
    return build_model(cfg, trace_spec(stock_spec(cfg), tc), seed=0)


def test_fc2_rows_are_counted_by_their_own_tokens_mask():
    """With a ``token_mask``, each FC2 row counts (or not) by the mask of its own token, not of the token at its
    batch-major index: an invalid row of a real token (1, 9) is counted, one of a padding token (1, 13) is not."""
    model = _model(TraceConfig(guided_layers="all"))
    data = batch()
    with trace_record(model) as h, torch.no_grad():
        model(*data[:3])
    roll = h.recorded()
    B, S = data[0].shape
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 12:] = False
    sites = dict(roll.sites)
    key = (2, "expert_fc2_in")
    sg = sites[key]
    valid = sg.valid.clone()
    valid[1, 9, 0] = False  # real: counted invalid (its batch-major row 25 is the padding token (s=12, b=1))
    valid[1, 13, 1] = False  # padding: not counted
    sites[key] = SiteGuidance(sg.record, valid, sg.expert_ids)
    with trace_guidance(model, StepGuidance(sites=sites, routing=roll.routing, token_mask=mask)) as h, \
            torch.no_grad():
        model(*data[:3])
    stats = h.stats()
    real = int(mask.sum())
    assert stats[(2, "expert_fc2_in", "invalid_row")] == 1
    assert stats[(2, "expert_fc2_in", "used")] == real * TOPK - 1
    assert stats[(1, "expert_fc2_in", "used")] == real * TOPK
    assert dict(h.counter.fallback) == {"invalid_row": 1}


def test_mxfp4_ignores_the_per_tensor_amax_setting():
    """MXFP4 has no global amax: ``activation_amax='per_tensor'`` changes nothing (same output, same records)."""
    data = batch()
    out, recs = {}, {}
    for amax in ("per_row", "per_tensor"):
        model = _model(TraceConfig(format="mxfp4", activation_amax=amax))
        with trace_record(model) as h, torch.no_grad():
            out[amax] = model(*data[:3])
        recs[amax] = h.recorded().sites
    assert torch.equal(out["per_row"], out["per_tensor"])
    for key, sg in recs["per_row"].items():
        other = recs["per_tensor"][key]
        assert torch.equal(payload_of(sg.record), payload_of(other.record)), key
        assert torch.equal(sg.record.block_scales.view(torch.uint8), other.record.block_scales.view(torch.uint8))
        assert other.record.global_amax is None
