"""The MoE step's row plumbing (``megatron/moe_step.py``): virtual tokens, per-token counting under a token mask,
formats that ignore the per-tensor amax."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.site import SiteGuidance
from megatron_trace.megatron import StepGuidance, trace_guidance, trace_record, trace_spec
from megatron_trace.megatron.moe_step import _virtual_experts, _virtual_token_ids
from megatron_trace.megatron.rows import map_record, payload_of

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
    fc1 = sites[(2, "expert_fc1_in")]
    valid1 = fc1.valid.clone()
    valid1[0, 2] = False  # real: counted invalid; the padding's valid rows are not used rows
    sites[(2, "expert_fc1_in")] = SiteGuidance(fc1.record, valid1)
    with trace_guidance(model, StepGuidance(sites=sites, routing=roll.routing, token_mask=mask)) as h, \
            torch.no_grad():
        model(*data[:3])
    stats = h.stats()
    real = int(mask.sum())
    assert stats[(2, "expert_fc2_in", "invalid_row")] == 1
    assert stats[(2, "expert_fc2_in", "used")] == real * TOPK - 1
    assert stats[(1, "expert_fc2_in", "used")] == real * TOPK
    assert stats[(2, "expert_fc1_in", "invalid_row")] == 1
    assert stats[(2, "expert_fc1_in", "used")] == real - 1
    assert dict(h.counter.fallback) == {"invalid_row": 2}


def test_layers_outside_the_policy_count_only_real_tokens_as_not_guided():
    """Last 2 layers guided, with a ``token_mask``: the FC1 and FC2 rows of layers 0-1 are counted as not guided,
    one per real token (FC1) and per real (token, expert) row (FC2); padding is not counted."""
    model = _model(TraceConfig(guided_layers="last_k", guided_last_k=2))
    data = batch()
    with trace_record(model) as h, torch.no_grad():
        model(*data[:3])
    roll = h.recorded()
    mask = torch.ones(data[0].shape, dtype=torch.bool)
    mask[0, 10:] = False
    with trace_guidance(model, StepGuidance(sites=roll.sites, routing=roll.routing, token_mask=mask)) as h, \
            torch.no_grad():
        model(*data[:3])
    stats, real = h.stats(), int(mask.sum())
    for layer in (0, 1):
        assert stats[(layer, "expert_fc1_in", "not_guided_layer")] == real
        assert stats[(layer, "expert_fc2_in", "not_guided_layer")] == real * TOPK
    assert stats[(3, "expert_fc2_in", "used")] == real * TOPK


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


def test_without_replay_each_fc2_row_falls_back_for_one_reason():
    """Routing of its own (no replay) over records of another model: each FC2 row is used, or counted once as of
    another expert or as invalid (an invalid record of another expert is a mismatch, not both)."""
    tc = TraceConfig(guided_layers="all", routing_replay=False)
    data = batch()
    cfg = tiny_config()
    rollout = build_model(cfg, trace_spec(stock_spec(cfg), tc), seed=7)  # another model: other experts
    with trace_record(rollout) as h, torch.no_grad():
        rollout(*data[:3])
    roll = h.recorded()
    sites = dict(roll.sites)
    sg = sites[(0, "expert_fc2_in")]
    sites[(0, "expert_fc2_in")] = SiteGuidance(sg.record, torch.zeros_like(sg.valid), sg.expert_ids)
    trainer = _model(tc)
    with trace_guidance(trainer, StepGuidance(sites=sites, routing=roll.routing)) as h, torch.no_grad():
        trainer(*data[:3])
    stats = h.stats()
    rows = data[0].numel() * TOPK
    for layer in range(4):
        got = {r: v for (lay, site, r), v in stats.items() if lay == layer and site == "expert_fc2_in" and v}
        assert sum(got.values()) == rows, (layer, got)
        assert got.get("expert_mismatch", 0) > 0, layer
    assert set({r for (lay, site, r), v in stats.items() if lay == 0 and site == "expert_fc2_in" and v}) == {
        "expert_mismatch", "invalid_row"}


@pytest.mark.parametrize("site", ["expert_fc1_in", "expert_fc2_in"])
def test_records_of_a_longer_sequence_fall_back_by_shape(site):
    """Records of [B, S + 4] for a [B, S] batch: batch-major rows b * S + s would be another token's for b > 0,
    so the layer falls back (counted ``shape``), not guided by them."""
    model = _model(TraceConfig(guided_layers="all"))
    data = batch()
    with trace_record(model) as h, torch.no_grad():
        model(*data[:3])
    roll = h.recorded()
    sg = roll.sites[(1, site)]
    longer = lambda x: torch.cat([x, x[:, :4]], 1)  # noqa: E731
    r = sg.record
    rec = map_record(r, longer, (r.shape[0], r.shape[1] + 4, *r.shape[2:]))
    ids = None if sg.expert_ids is None else longer(sg.expert_ids)
    sites = {**roll.sites, (1, site): SiteGuidance(rec, longer(sg.valid), ids)}
    with trace_guidance(model, StepGuidance(sites=sites, routing=roll.routing)) as h, torch.no_grad():
        model(*data[:3])
    rows = data[0].numel() * (TOPK if site == "expert_fc2_in" else 1)
    assert h.stats()[(1, site, "shape")] == rows
    assert dict(h.counter.fallback) == {"shape": rows}
