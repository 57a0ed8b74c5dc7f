"""Issue 11 item 4: Megatron's activation recomputation inside ``trace_guidance`` replays the same routing and
guided codes (gradients bit-equal to a run without recompute) and counts every row once."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import StepGuidance, trace_guidance, trace_spec

from ..megatron.harness import batch, build_model, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")

TC = TraceConfig(guided_layers="last_k", guided_last_k=2)
RECOMPUTE = {
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}


def _model(**mcfg):
    cfg = tiny_config(**mcfg)
    return build_model(cfg, trace_spec(stock_spec(cfg), TC))


@pytest.fixture(scope="module")
def rollout():
    data = batch()
    roll = _model(init_method_std=0.051)  # a slightly different model: guidance differs from own RNE
    tokens, pos, mask, _ = data
    with trace_guidance(roll, record=True, compact=False) as h, torch.no_grad():
        roll(tokens, pos, mask)
    return data, h.recorded()


def _train_step(model, data, guidance, *, backward_inside=True):
    """Forward + backward; returns (counter, stats, grads, recorded, router outputs per layer)."""
    tokens, pos, mask, labels = data
    seen, hooks = {}, []
    for layer in model.decoder.layers:
        hooks.append(layer.mlp.router.register_forward_hook(
            lambda m, a, out, i=layer.layer_number - 1: seen.setdefault(i, []).append(out[1].clone())))
    step = StepGuidance(sites=guidance.sites, routing=guidance.routing)
    with trace_guidance(model, step, record=True, compact=False) as h:
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return h.counter, h.stats(), grads, h.recorded(), seen


@pytest.mark.parametrize("kind", list(RECOMPUTE))
def test_recompute_reuses_guidance_and_routing_and_counts_once(rollout, kind):
    data, roll = rollout
    c0, s0, g0, r0, seen0 = _train_step(_model(), data, roll)
    c1, s1, g1, r1, seen1 = _train_step(_model(**RECOMPUTE[kind]), data, roll)
    assert c0.used > 0 and c0.fallback["not_guided_layer"] > 0
    assert (c1.used, dict(c1.fallback)) == (c0.used, dict(c0.fallback)) and s1 == s0  # counted once
    assert all(len(v) == 2 for v in seen1.values())  # the router ran again in the backward ...
    for layer, outs in seen1.items():  # ... with the replayed routing both times
        assert torch.equal(outs[0], seen0[layer][0]) and torch.equal(outs[1], seen0[layer][0]), layer
    assert g1.keys() == g0.keys() and all(torch.equal(g1[n], g0[n]) for n in g0)  # same codes: same gradients
    for key, sg in r0.sites.items():
        assert torch.equal(r1.sites[key].record.codes, sg.record.codes), key


@pytest.mark.parametrize("kind", list(RECOMPUTE))
def test_backward_outside_the_context_raises(rollout, kind):
    """Why the context must wrap the backward: outside it the recompute would run the trainer's own rounding and
    routing, and the gradients would differ from the step's forward. It raises (it used to be silent)."""
    data, roll = rollout
    with pytest.raises(RuntimeError, match="recomputes a forward that ran inside trace_guidance, outside the context"):
        _train_step(_model(**RECOMPUTE[kind]), data, roll, backward_inside=False)


@pytest.mark.parametrize("kind", list(RECOMPUTE))
def test_weight_reuse_with_recompute_gives_the_same_gradients(kind):
    """``reuse_weight_quant`` over micro-batches whose backward recomputes the experts: the recompute takes the
    kept weights too, and the gradients equal a run without reuse and without recompute."""
    from megatron_trace.megatron import reuse_weight_quant

    micro = [batch(seed=s) for s in range(2)]

    def grads(model, reuse):
        model.zero_grad(set_to_none=True)
        with reuse_weight_quant(model) if reuse else torch.enable_grad():
            for tokens, pos, mask, labels in micro:
                model(tokens, pos, mask, labels=labels).float().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads(_model(), reuse=False)
    got = grads(_model(**RECOMPUTE[kind]), reuse=True)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
