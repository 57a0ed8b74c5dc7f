"""The experts' weights fake-quantized as their MoE layer starts (``prepare_weights``, a forward pre-hook that
``find_trace_layers`` installs): the same outputs and gradients, bit for bit, as quantizing them inside the
experts' forward, and never a stale value. Either way the expert linears' forward pre-hooks run before their
weights are read (Megatron's DDP finishes a parameter all-gather there)."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import StepGuidance, experts, find_trace_layers, trace_guidance, trace_record, trace_spec

from .harness import EXPERTS, batch, build_model, logits, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")
LINEARS = {"linear_fc1", "linear_fc2"}


def _model(**trace):
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(**trace)))
    return model, find_trace_layers(model)


def _step(model, layers, data, early: bool, monkeypatch, guidance=None):
    """Loss and gradients of one forward + backward; also what each experts module held when its forward began."""
    monkeypatch.setattr(experts, "EARLY_WEIGHTS", early)
    seen = []
    hooks = [m.experts.register_forward_pre_hook(lambda e, args: seen.append(set(e._prepared or ())))
             for m in layers.moe.values()]
    model.zero_grad(set_to_none=True)
    try:
        if guidance is None:
            loss = model(*data[:3], labels=data[3]).float().mean()
            loss.backward()
        else:
            with trace_guidance(model, StepGuidance(sites=guidance.sites, routing=guidance.routing)):
                loss = model(*data[:3], labels=data[3]).float().mean()
                loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, seen


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_prepared_weights_give_the_same_loss_and_gradients(fmt, monkeypatch):
    model, layers = _model(format=fmt)
    data = batch(seed=3)
    want_loss, want, seen_late = _step(model, layers, data, False, monkeypatch)
    got_loss, got, seen_early = _step(model, layers, data, True, monkeypatch)
    assert seen_late == [set()] * len(layers.moe) and seen_early == [LINEARS] * len(layers.moe)
    assert torch.equal(got_loss, want_loss)
    assert set(got) == set(want) and any("local_experts" in n for n in got)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert all(m.experts._prepared is None for m in layers.moe.values())  # not kept past the forward


def test_guided_steps_use_the_prepared_weights_too(monkeypatch):
    model, layers = _model(guided_layers="all")
    data = batch(seed=5)
    with trace_record(model) as h, torch.no_grad():
        model(*data[:3])
    roll = h.recorded()
    want_loss, want, _ = _step(model, layers, data, False, monkeypatch, guidance=roll)
    got_loss, got, seen = _step(model, layers, data, True, monkeypatch, guidance=roll)
    assert seen == [LINEARS] * len(layers.moe)
    assert torch.equal(got_loss, want_loss)
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_weights_changed_after_preparing_are_quantized_again():
    model, layers = _model()
    ex = next(iter(layers.moe.values())).experts
    ex.prepare_weights()
    stale = ex._prepared["linear_fc1"][1].detach().clone()
    weights = [e.linear_fc1.weight for e in ex.local_experts]
    with torch.no_grad():
        weights[-1].mul_(0.5)  # what an optimizer step does between a prepare and a forward
    got = ex._stacked("linear_fc1")
    want = ex.quantize_weights(torch.stack(weights))
    assert torch.equal(got, want) and not torch.equal(got, stale)
    assert "linear_fc1" not in ex._prepared  # taken (and dropped) by the first use


def test_the_hook_is_installed_once():
    model, layers = _model()
    moe = next(iter(layers.moe.values()))
    before = len(moe._forward_pre_hooks)
    moe.experts.hook_moe_layer(moe)
    find_trace_layers(model)
    assert len(moe._forward_pre_hooks) == before >= 1



@pytest.mark.parametrize("early", [True, False])
def test_the_linears_pre_hooks_run_before_their_weights_are_read(early, monkeypatch):
    """A pre-hook on each expert linear that writes the weights' values in place, as Megatron's DDP all-gather
    does with ``overlap_param_gather``: the experts compute with the written values (the logits of a model that
    held them from the start)."""
    monkeypatch.setattr(experts, "EARLY_WEIGHTS", early)
    model, layers = _model()
    target, _ = _model()
    with torch.no_grad():
        for name, p in target.named_parameters():
            if ".local_experts." in name:
                p.mul_(-1.5)
    data = batch(seed=7)
    want = logits(target, data)
    values = dict(target.named_modules())
    calls = []

    def gather(module, args, kwargs):  # (with_kwargs: Megatron-FSDP's signature; DDP's is (module, *unused))
        calls.append(module)
        module.weight.data.copy_(values[names[module]].weight)

    names = {m: n for n, m in model.named_modules() if ".local_experts." in n and n.endswith(tuple(LINEARS))}
    assert not torch.equal(logits(model, data), want)  # the values the hooks write matter
    for m in names:
        m.register_forward_pre_hook(gather, with_kwargs=True)
    assert torch.equal(logits(model, data), want)
    assert set(calls) == set(names) and len(names) == len(layers.moe) * 2 * EXPERTS
