"""Issue 11 item 4: guidance and routing bind to module identity (layer id, site), never to list position;
stray keys warn, missing routing errors; coverage and fallback reasons come from one per-step function."""

import logging

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.formats import e2m1
from megatron_trace.megatron import (
    GuidanceCoverageError,
    GuidanceFallbackError,
    StepGuidance,
    find_trace_layers,
    trace_guidance,
    trace_spec,
)
from megatron_trace.megatron.step import NOT_GUIDED
from megatron_trace.metrics import NOT_GUIDED_REASON, guidance_step_metrics

from ..megatron.harness import EXPERTS, TOPK, batch, build_model, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")

T = 2 * 16


def _model(tc, **mcfg):
    cfg = tiny_config(**mcfg)
    return build_model(cfg, trace_spec(stock_spec(cfg), tc))


def _run(model, data, step=None):
    tokens, pos, mask, _ = data
    with trace_guidance(model, step, record=True, compact=False) as h, torch.no_grad():
        model(tokens, pos, mask)
    return h


def _router_maps(model):
    maps, hooks = {}, []
    for layer in model.decoder.layers:
        if hasattr(layer.mlp, "router"):
            lid = layer.layer_number - 1
            hooks.append(layer.mlp.router.register_forward_hook(lambda m, a, out, i=lid: maps.__setitem__(i, out[1])))
    return maps, hooks


def _values(sg):
    return e2m1.decode(e2m1.unpack(sg.record.codes))[..., : sg.record.shape[-1]]


def _distinct_routing(layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(T)]).reshape(2, 16, TOPK)
            for i in layers}


def test_layers_found_in_another_order_bind_by_layer_id():
    """The decoder's layer list is reversed (the model runs layer 3 first): each router replays routing[its id]
    and each layer's guided codes are that layer's records (binding by position would give other layers')."""
    tc = TraceConfig(guided_layers="all")
    model = _model(tc)
    model.decoder.layers = torch.nn.ModuleList(list(model.decoder.layers)[::-1])
    data = batch()
    routing = _distinct_routing(range(4))
    maps, hooks = _router_maps(model)
    own = _run(model, data, StepGuidance(routing=routing)).recorded()
    guided = _run(model, data, StepGuidance(sites=own.sites, routing=routing)).recorded()
    for h in hooks:
        h.remove()
    for i in range(4):
        idx = routing[i].transpose(0, 1).reshape(T, TOPK)  # Megatron token order
        assert torch.equal(maps[i], torch.zeros(T, EXPERTS, dtype=torch.bool).scatter(1, idx, True)), i
        for site in ("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v"):
            assert torch.equal(_values(guided.sites[(i, site)]), _values(own.sites[(i, site)])), (i, site)
    assert list(find_trace_layers(model).moe) == [3, 2, 1, 0]  # found in list order, keyed by id


def test_a_dense_layer_skips_an_id_without_shifting_the_others():
    """Layer 0 is dense: MoE layers are 1..3 (positions 0..2); routing keyed 1..3 binds to layers 1..3."""
    model = _model(TraceConfig(guided_layers="all"), moe_layer_freq=[0, 1, 1, 1])
    assert sorted(find_trace_layers(model).moe) == [1, 2, 3]
    routing = _distinct_routing(range(1, 4))
    maps, hooks = _router_maps(model)
    h = _run(model, batch(), StepGuidance(routing=routing))
    for hook in hooks:
        hook.remove()
    for i in (1, 2, 3):
        idx = routing[i].transpose(0, 1).reshape(T, TOPK)
        assert torch.equal(maps[i], torch.zeros(T, EXPERTS, dtype=torch.bool).scatter(1, idx, True)), i
    assert h.stats()[(0, "kv_k", "used")] == 0 and (0, "expert_fc1_in", "used") not in h.stats()


def test_mtp_layers_keep_the_stock_spec_and_take_no_guidance():
    """A multi-token-prediction layer built as the Megatron-LM patch builds it (the stock spec; its transformer layer
    is layer id 4 of a 4-layer model) is not a guided layer: it binds no records or routing, counts no rows, and
    routes itself, so a guided step with the decoder's records and routing reproduces the recorded step (USER_NEEDS.md
    §6)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from ..megatron.harness import mtp_spec

    cfg = tiny_config(mtp_num_layers=1)
    spec = trace_spec(stock_spec(cfg), TraceConfig(guided_layers="all"))
    model = build_model(cfg, spec, mtp_block_spec=mtp_spec(cfg))
    mtp_layer = model.mtp.layers[0].transformer_layer
    assert mtp_layer.layer_number - 1 == 4 and type(mtp_layer.mlp.experts) is SequentialMLP  # the stock experts
    layers = find_trace_layers(model)
    assert sorted(layers.moe) == sorted(layers.kv) == [0, 1, 2, 3]
    tokens, pos, mask, labels = batch()
    with trace_guidance(model, StepGuidance(), record=True, compact=False) as h, torch.no_grad():
        want = model(tokens, pos, mask, labels=labels)
    rec = h.recorded()
    assert sorted(rec.routing) == [0, 1, 2, 3] and {k[0] for k in rec.sites} == {0, 1, 2, 3}
    with trace_guidance(model, StepGuidance(sites=rec.sites, routing=rec.routing)) as h, torch.no_grad():
        got = model(tokens, pos, mask, labels=labels)
    assert torch.equal(got, want) and {k[0] for k in h.stats()} == {0, 1, 2, 3}
    assert h.counter.coverage == 1.0 and not h.counter.fallback


def test_stray_keys_warn_and_missing_routing_errors(caplog):
    tc = TraceConfig(guided_layers="all", sites=("expert_fc1_in", "expert_fc2_in", "weights"),
                     guided_sites=("expert_fc1_in", "expert_fc2_in"))
    model, data = _model(tc), batch()
    rec = _run(_model(TraceConfig(guided_layers="all")), data).recorded()
    sites = {**rec.sites, (9, "expert_fc1_in"): rec.sites[(0, "expert_fc1_in")]}  # layer 9 of a 4-layer model
    with caplog.at_level(logging.WARNING, logger="megatron_trace.megatron.context"):
        _run(model, data, StepGuidance(sites=sites, routing=rec.routing))
    assert "layers [9] outside 0..3" in caplog.text and "(0, 'kv_k')" in caplog.text  # KV is not quantized
    routing = {k: v for k, v in rec.routing.items() if k != 2}
    with pytest.raises(ValueError, match=r"routing indices are missing for MoE layers \[2\]"):
        _run(model, data, StepGuidance(routing=routing))


@pytest.fixture(scope="module")
def rollout():
    tc = TraceConfig(guided_layers="last_k", guided_last_k=2)
    data = batch()
    return tc, data, _run(_model(tc, init_method_std=0.051), data).recorded()


def test_one_function_gives_the_per_step_log(rollout):
    """Coverage counts guided sites only (layers 0-1 are outside the policy); reasons are logged by name."""
    tc, data, roll = rollout
    sites = {k: v for k, v in roll.sites.items() if k != (3, "expert_fc1_in")}
    h = _run(_model(tc), data, StepGuidance(sites=sites, routing=roll.routing))
    m = guidance_step_metrics(h.counter, h.stats())
    assert NOT_GUIDED_REASON == NOT_GUIDED  # metrics.py cannot import the plugin: the reason names must agree
    per_layer = T + T * TOPK + T + T  # fc1, fc2, kv_k, kv_v rows
    assert m["guidance/fallback/not_guided_layer"] == 2 * per_layer
    assert m["guidance/fallback/missing"] == T
    assert m["guidance/rows_used"] == 2 * per_layer - T
    assert m["guidance/coverage"] == pytest.approx((2 * per_layer - T) / (2 * per_layer)) == h.coverage()
    assert m["quant/guided_fallback_rate"] == pytest.approx(T / (2 * per_layer))
    assert m["guidance/coverage/expert_fc1_in"] == pytest.approx(0.5) and m["guidance/coverage/kv_k"] == 1.0


def test_fallback_flag_and_min_coverage(rollout):
    tc, data, roll = rollout
    full = StepGuidance(sites=roll.sites, routing=roll.routing, min_coverage=1.0)
    assert _run(_model(tc), data, full).coverage() == 1.0  # not-guided layers do not lower coverage
    sites = {k: v for k, v in roll.sites.items() if k[0] != 3}
    h = _run(_model(tc), data, StepGuidance(sites=sites, routing=roll.routing, fallback="rne"))
    assert h.counter.fallback["missing"] > 0 and h.coverage() == 0.5
    with pytest.raises(GuidanceFallbackError, match="layer 3 site .* fallback='fail'"):
        _run(_model(tc), data, StepGuidance(sites=sites, routing=roll.routing, fallback="fail"))
    with pytest.raises(GuidanceCoverageError, match="coverage 0.5000 at guided sites is below min_coverage=0.6"):
        _run(_model(tc), data, StepGuidance(sites=sites, routing=roll.routing, min_coverage=0.6))
