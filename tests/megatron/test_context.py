"""``trace_guidance``'s own checks and bookkeeping (``megatron/context.py``): what a ``StepGuidance`` refuses, the
cached walk of the model, and how a context's rows are counted (the forwards themselves: test_guidance.py,
test_microbatches.py, ../operability/test_guidance_keys.py)."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import StepGuidance, find_trace_layers, trace_spec

from .harness import SEQ, TOPK, build_model, stock_spec, tiny_config


def _recorded(config: TraceConfig, **cfg_kw):
    """A TRACE model of the tiny config, a batch, and the records and routing of one recorded forward of it."""
    from megatron_trace.megatron import trace_record

    from .harness import batch

    cfg = tiny_config(**cfg_kw)
    model = build_model(cfg, trace_spec(stock_spec(cfg), config))
    tokens, pos, mask, _ = batch()
    with trace_record(model) as h, torch.no_grad():
        out = model(tokens, pos, mask)
    return model, (tokens, pos, mask), h.recorded(), out

def test_step_guidance_refuses_what_no_layer_could_take():
    """Each would be taken silently otherwise: a negative layer id is neither a layer of this rank nor "outside"
    (no warning), nor is a bool one (True was layer 1), [B, S] routing has no topk axis, an int token mask is no bool
    mask."""
    with pytest.raises(ValueError, match=r"guidance key \(-1, 'kv_k'\) must be \(layer id >= 0, site\)"):
        StepGuidance(sites={(-1, "kv_k"): None})
    with pytest.raises(ValueError, match=r"guidance key \(True, 'kv_k'\) must be \(layer id >= 0, site\)"):
        StepGuidance(sites={(True, "kv_k"): None})  # (bound as layer 1 before)
    for layer in (True, -1, "0"):
        with pytest.raises(ValueError, match=rf"routing key {layer!r} must be a layer id >= 0"):
            StepGuidance(routing={layer: torch.zeros(2, SEQ, TOPK, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"routing\[0\] must be int64 \[B, S, topk\], got torch.int64 \(2, 16\)"):
        StepGuidance(routing={0: torch.zeros(2, SEQ, dtype=torch.int64)})
    with pytest.raises(ValueError, match="token_mask must be bool"):
        StepGuidance(token_mask=torch.ones(2, SEQ, dtype=torch.int64))
    StepGuidance(sites={(0, "kv_k"): None}, routing={0: torch.zeros(2, SEQ, TOPK, dtype=torch.int64)},
                 token_mask=torch.ones(2, SEQ, dtype=torch.bool), min_coverage=1.0)  # the edges are accepted


@pytest.mark.parametrize("kw,err,match", [
    # were: True a min_coverage of 1.0; "0.5", a list of routing indices, a dict counter or a record that is no
    # SiteGuidance a bare TypeError / AttributeError (the last ones in the forward)
    (dict(min_coverage=True), ValueError, r"min_coverage=True must be None or a number in \[0, 1\]"),
    (dict(min_coverage="0.5"), ValueError, r"min_coverage='0.5' must be None or a number in \[0, 1\]"),
    (dict(routing={0: [[[0, 1]]]}), TypeError, r"routing\[0\] must be an int64 tensor \[B, S, topk\], got list"),
    (dict(counter={}), TypeError, "counter must be a FallbackCounter, got dict"),
    (dict(sites={(0, "kv_k"): "record"}), TypeError, r"guidance \(0, 'kv_k'\) must be a SiteGuidance \(or None: "
                                                     r"missing\), got str"),
], ids=["coverage-bool", "coverage-str", "routing-list", "counter-dict", "site-str"])
def test_step_guidance_names_arguments_of_the_wrong_type(kw, err, match):
    with pytest.raises(err, match=match):
        StepGuidance(**kw)


@pytest.mark.usefixtures("world1")
def test_the_cached_walk_is_not_taken_for_more_chunks():
    """A list of chunks that starts with a walked model is walked again (its other chunks' modules are found): here
    they claim the same layer ids, which the walk refuses, not the first chunk's layers returned alone."""
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig()))
    other = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig()))
    assert sorted(find_trace_layers(model).moe) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="two TRACE modules claim layer id 0"):
        find_trace_layers([model, other])


@pytest.mark.usefixtures("world1")
def test_contexts_do_not_nest_on_a_dense_model():
    """A dense model (the KV sites alone, no experts to find bound): the attention modules' binding is what tells an
    open context; a nested one would rebind them, and the outer context's exit would then unbind the inner's."""
    from megatron_trace.megatron import trace_guidance

    cfg = tiny_config(num_moe_experts=None, moe_ffn_hidden_size=None, moe_enable_routing_replay=False)
    kv = ("kv_k", "kv_v")
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(sites=kv, guided_sites=kv)))
    assert not find_trace_layers(model).moe
    with trace_guidance(model):
        with pytest.raises(RuntimeError, match="do not nest"):
            with trace_guidance(model):
                pass



@pytest.mark.usefixtures("world1")
def test_contexts_do_not_nest_on_a_moe_model_without_kv_sites():
    """Without the KV sites (no attention module to find bound) the experts' binding is what tells an open context:
    a nested one would rebind them to its own guidance."""
    from megatron_trace.megatron import trace_guidance

    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(sites=("expert_fc1_in", "weights"),
                                                                      guided_sites=("expert_fc1_in",))))
    assert not find_trace_layers(model).kv and find_trace_layers(model).moe
    with trace_guidance(model):
        with pytest.raises(RuntimeError, match="do not nest"):
            with trace_guidance(model):
                pass

@pytest.mark.usefixtures("world1")
def test_a_forward_after_a_replaying_context_routes_itself():
    """The context leaves Megatron's router replay as it found it: a forward after it (plain QAT, an evaluation)
    routes by its own scores, not by the last micro-batch's replayed experts, and no replayed indices stay held."""
    from megatron_trace.megatron import trace_guidance

    from .harness import batch

    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(guided_layers="all")))
    tokens, pos, mask, _ = batch()
    routing = _routing(range(4))
    with torch.no_grad():
        own = model(tokens, pos, mask)
        with trace_guidance(model, StepGuidance(routing=routing)):
            replayed = model(tokens, pos, mask)
        after = model(tokens, pos, mask)
    assert not torch.equal(replayed, own) and torch.equal(after, own)
    replays = [layer.mlp.router.router_replay for layer in model.decoder.layers]
    assert all(rr.router_replay_action is None and rr.target_topk_idx is None for rr in replays)


@pytest.mark.usefixtures("world1")
def test_a_key_at_layer_num_layers_is_outside_the_model(caplog):
    """Layer ids run 0..num_layers-1: records keyed num_layers (HF's id of the first MTP layer, which the trainer
    never guides) match no rank's module and are said to, as a producer/consumer mismatch."""
    import logging

    from megatron_trace.megatron import trace_guidance

    model, _, rec, _ = _recorded(TraceConfig(guided_layers="all"))
    with caplog.at_level(logging.WARNING, logger="megatron_trace.megatron.context"):
        with trace_guidance(model, StepGuidance(sites={(4, "kv_k"): rec.sites[(3, "kv_k")]}, routing=rec.routing)):
            pass
    assert "layers [4] outside 0..3" in caplog.text


@pytest.mark.usefixtures("world1")
def test_routing_is_ignored_without_replay(caplog):
    """``routing_replay=False``: the routing given is ignored whole (a warning): the layers route themselves, and
    layers it leaves out are no error, as they are with replay."""
    import logging

    from megatron_trace.megatron import trace_guidance

    from .harness import batch

    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(routing_replay=False)))
    tokens, pos, mask, _ = batch()
    with torch.no_grad():
        with trace_guidance(model):
            own = model(tokens, pos, mask)
        with caplog.at_level(logging.WARNING, logger="megatron_trace.megatron.context"):
            with trace_guidance(model, StepGuidance(routing=_routing(range(4)))):
                got = model(tokens, pos, mask)
            with trace_guidance(model, StepGuidance(routing=_routing([0]))):
                pass
    assert torch.equal(got, own)
    assert "routing indices are ignored: TraceConfig.routing_replay=False" in caplog.text


def _routing(layers, seed=0):
    """Distinct random experts per token, [2, SEQ, TOPK] for each of ``layers``."""
    from .harness import EXPERTS

    g = torch.Generator().manual_seed(seed)
    return {i: torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(2 * SEQ)]).view(2, SEQ, TOPK)
            for i in layers}


@pytest.mark.usefixtures("world1")
def test_records_that_do_not_fit_a_layer_outside_the_policy_do_not_fail_the_step():
    """``fallback='fail'`` fails on guided sites only: records at layer 0 (outside ``last_k=2``) that fit neither
    its experts nor its KV heads are set aside, as its rows are not guided; the guided layers use theirs."""
    from megatron_trace.megatron import trace_guidance

    model, (tokens, pos, mask), rec, _ = _recorded(TraceConfig(guided_layers="last_k", guided_last_k=2))
    sites = {**rec.sites, (0, "expert_fc1_in"): rec.sites[(0, "kv_k")], (0, "kv_k"): rec.sites[(0, "expert_fc1_in")]}
    with trace_guidance(model, StepGuidance(sites=sites, routing=rec.routing, fallback="fail")) as h, torch.no_grad():
        model(tokens, pos, mask)
    assert h.coverage() == 1.0 and h.counter.used > 0 and set(h.counter.fallback) == {"not_guided_layer"}


@pytest.mark.usefixtures("world1")
def test_expert_records_are_checked_against_the_experts_dims():
    """FC1 rows are hidden_size wide, FC2 rows topk x moe_ffn_hidden_size: with the two different, the recorded
    step's records fit and guide every row (either dim taken for the other would reject them all)."""
    from megatron_trace.megatron import trace_guidance

    model, (tokens, pos, mask), rec, want = _recorded(TraceConfig(guided_layers="all"), moe_ffn_hidden_size=32)
    assert rec.sites[(0, "expert_fc2_in")].record.shape[2:] == (TOPK, 32)
    with trace_guidance(model, StepGuidance(sites=rec.sites, routing=rec.routing)) as h, torch.no_grad():
        got = model(tokens, pos, mask)
    assert torch.equal(got, want) and h.coverage() == 1.0 and not h.counter.fallback
    stats = h.stats()
    assert all(stats[(layer, site, "used")] > 0 for layer in range(4) for site in ("expert_fc1_in", "expert_fc2_in"))


@pytest.mark.usefixtures("world1")
def test_fallback_fail_raises_in_the_forward_of_the_layer():
    """``fallback='fail'``: the layer whose rows have no guidance raises as it runs (its forward, before the
    later layers and any backward), not at the context's exit."""
    from megatron_trace.megatron import GuidanceFallbackError, trace_guidance

    model, (tokens, pos, mask), rec, _ = _recorded(TraceConfig(guided_layers="all"))
    ran = []
    hook = model.decoder.layers[2].register_forward_pre_hook(lambda m, a: ran.append(2))
    sites = {k: v for k, v in rec.sites.items() if k != (1, "expert_fc1_in")}
    with pytest.raises(GuidanceFallbackError, match="layer 1 site 'expert_fc1_in'"):
        with trace_guidance(model, StepGuidance(sites=sites, routing=rec.routing, fallback="fail")), torch.no_grad():
            model(tokens, pos, mask)
    hook.remove()
    assert not ran  # raised in layer 1


@pytest.mark.usefixtures("world1")
def test_the_configs_min_coverage_holds_where_no_step_gives_one():
    """``TraceConfig.min_coverage`` is the step's floor unless a ``StepGuidance`` overrides it: half the guided
    layers' records missing fails a config asking for 0.9, and passes where the step asks for 0.5."""
    from megatron_trace.megatron import GuidanceCoverageError, trace_guidance

    from .harness import batch

    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(guided_layers="all", min_coverage=0.9)))
    tokens, pos, mask, _ = batch()
    with trace_guidance(model, StepGuidance(min_coverage=0.0), record=True) as h, torch.no_grad():
        model(tokens, pos, mask)  # (the recording step has no records: coverage 0)
    rec = h.recorded()
    sites = {k: v for k, v in rec.sites.items() if k[0] >= 2}
    with pytest.raises(GuidanceCoverageError, match="coverage 0.5000 at guided sites is below min_coverage=0.9"):
        with trace_guidance(model, StepGuidance(sites=sites, routing=rec.routing)), torch.no_grad():
            model(tokens, pos, mask)
    with trace_guidance(model, StepGuidance(sites=sites, routing=rec.routing, min_coverage=0.5)), torch.no_grad():
        model(tokens, pos, mask)


@pytest.mark.usefixtures("world1")
def test_rows_read_inside_the_context_are_the_forwards_so_far():
    """``h.stats()`` and ``h.counter`` read before the context exits hold the rows of the forward that ran (its
    deferred device counts resolved then), the same as after the exit."""
    from megatron_trace.megatron import trace_guidance

    model, (tokens, pos, mask), rec, _ = _recorded(TraceConfig(guided_layers="last_k", guided_last_k=2))
    for first in ("stats", "counter"):  # (either read resolves the step's pending counts)
        with trace_guidance(model, StepGuidance(sites=rec.sites, routing=rec.routing)) as h, torch.no_grad():
            model(tokens, pos, mask)
            early = h.stats() if first == "stats" else h.counter.used
        assert h.counter.used > 0 and early == (h.stats() if first == "stats" else h.counter.used), first
