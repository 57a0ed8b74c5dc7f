"""TRACE's experts inside Megatron MoE layers built with Megatron's other MoE features (fp16 parameters, the router's
dtype, score function, expert bias, pre-softmax, top-k scaling and group-limited routing, the legacy grouped-GEMM
spec, shared experts with and without their overlap, dense and MoE layers mixed by ``moe_layer_freq``): the trainer's
own rounding equals an independent fake-quant computation of the layer (``formats``' quantizers, Megatron's router
and shared experts), and guided by a rollout's records every MoE layer takes the rollout's scales and codes wherever
the rollout's code is one the trainer could round to, every row counted once as used.

The features change what reaches the experts (the tokens' routing weights, dtypes, which layers are MoE layers) and
what the layer adds to their output; the experts' numerics stay the spec's."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import StepGuidance, find_trace_layers, trace_guidance, trace_spec

from .harness import SEQ, TOPK, batch, build_model, perturb_non_experts, stock_spec, tiny_config
from .test_experts import _capture_moe, _reference_moe
from .test_guidance import _outside_bracket, _site_inputs, _values

pytestmark = pytest.mark.usefixtures("world1")

TC = TraceConfig(sites=("expert_fc1_in", "expert_fc2_in", "weights"), guided_sites=("expert_fc1_in", "expert_fc2_in"),
                 guided_layers="all")
T = 2 * SEQ  # tokens of the default batch

FEATURES = {
    "fp16_params": dict(params_dtype=torch.float16, bf16=False, fp16=True, pipeline_dtype=torch.float16),
    "router_dtype_fp32": dict(moe_router_dtype="fp32"),
    "router_dtype_fp64": dict(moe_router_dtype="fp64"),
    "topk_scaling_factor": dict(moe_router_topk_scaling_factor=2.5),
    "sigmoid_expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "pre_softmax": dict(moe_router_pre_softmax=True),
    "group_limited": dict(moe_router_num_groups=4, moe_router_group_topk=2),
    "legacy_grouped_gemm": dict(moe_grouped_gemm=True),
    "shared_experts_gated": dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True),
    "shared_experts_overlap": dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True,
                                   moe_token_dispatcher_type="alltoall"),
    "moe_layer_freq_list": dict(moe_layer_freq=[0, 1, 0, 1]),
}


def _models(kw):
    cfg = tiny_config(**kw)
    trainer = build_model(cfg, trace_spec(stock_spec(cfg), TC))
    rollout = build_model(cfg, trace_spec(stock_spec(cfg), TC))
    perturb_non_experts(rollout, 0.01)
    return trainer, rollout


def _moe_layers(model) -> list[int]:
    return sorted(find_trace_layers(model).moe)


def _own_rounding_is_the_independent_layer(model, layer: int) -> None:
    x, y = _capture_moe(model, layer, batch())
    moe = model.decoder.layers[layer].mlp
    want = _reference_moe(moe, x)
    if moe.shared_experts is not None:  # (Megatron adds them to the routed experts' output)
        with torch.no_grad():
            want = want + moe.shared_experts(x)
    assert y.dtype == x.dtype == moe.config.params_dtype
    assert torch.equal(y, want), layer


@pytest.mark.parametrize("feature", list(FEATURES))
def test_own_rounding_is_the_independent_layer_and_guided_layers_take_the_rollouts_scales_and_codes(feature):
    trainer, rollout = _models(FEATURES[feature])
    _own_rounding_is_the_independent_layer(trainer, _moe_layers(trainer)[-1])
    tokens, pos, mask, _ = batch()
    with trace_guidance(rollout, None, record=True, compact=False) as h, torch.no_grad():
        rollout(tokens, pos, mask)
    roll = h.recorded()
    layers = _moe_layers(trainer)
    assert sorted(roll.routing) == layers and sorted({k[0] for k in roll.sites}) == layers  # MoE layers only
    seen, hooks = _site_inputs(trainer)
    try:
        with trace_guidance(trainer, StepGuidance(sites=roll.sites, routing=roll.routing), record=True,
                            compact=False) as g, torch.no_grad():
            trainer(tokens, pos, mask)
    finally:
        for hook in hooks:
            hook.remove()
    guided = g.recorded()
    assert g.counter.used == len(layers) * (T + T * TOPK) and not g.counter.fallback  # each row once
    for layer in layers:
        assert torch.equal(guided.routing[layer], roll.routing[layer])
        for site in ("expert_fc1_in", "expert_fc2_in"):
            got, want = guided.sites[(layer, site)], roll.sites[(layer, site)]
            assert torch.equal(got.record.block_scales.view(torch.uint8), want.record.block_scales.view(torch.uint8))
        key = (layer, "expert_fc1_in")
        got, want = guided.sites[key], roll.sites[key]
        differ = _values(got) != _values(want)
        assert not bool((differ & ~_outside_bracket(seen[key], want)).any()), (feature, layer)


@pytest.mark.parametrize("scope,sites,graphed", [
    ("attn", None, r"\['attn'\] replays layer 0's KV site, .* \(4 in all\)"),
    ("moe_router,moe_preprocess", None, r"replays layer 0's MoE router, .* \(4 in all\)"),
    ("full", None, r"\(the whole layer\) replays layer 0's KV site, .* \(8 in all\)"),
    ("attn,moe_router", ("expert_fc1_in", "expert_fc2_in", "weights"),
     r"replays layer 0's MoE router, .* \(4 in all\)"),
], ids=["attention", "router", "whole_layer", "router_of_expert_sites"])
def test_cuda_graphs_over_trace_modules_are_refused_by_the_context(scope, sites, graphed):
    """Megatron's training CUDA graphs replay the scope's modules without their Python forward: the hooks that give
    each forward its micro-batch's guidance, routing and counts would be skipped (the graph replays what it captured),
    silently. Transformer Engine's graphs are captured by the training loop, so the model builds and runs eagerly here
    as it would before the capture; the context refuses it by name in training mode (TE's graphs replay training
    forwards only). A scope without TRACE modules is left alone."""
    tc = TraceConfig() if sites is None else TraceConfig(sites=sites, guided_sites=sites[:2])
    cfg = tiny_config(cuda_graph_impl="transformer_engine", cuda_graph_scope=scope)
    model = build_model(cfg, trace_spec(stock_spec(cfg), tc))
    with pytest.raises(ValueError, match=r"trace_guidance needs the TRACE modules' forwards to run eagerly, but "
                                         r"cuda_graph_impl='transformer_engine' with cuda_graph_scope .*" + graphed):
        with trace_guidance(model, None):
            pass
    model.eval()  # (TE's graphs replay training-mode forwards only: an evaluation forward, e.g. RL's log-probs, runs)
    with trace_guidance(model, None), torch.no_grad():
        model(*batch()[:3])
    tc = TraceConfig(sites=("kv_k", "kv_v"), guided_sites=("kv_k", "kv_v"))  # (the router's experts are Megatron's)
    cfg = tiny_config(cuda_graph_impl="transformer_engine", cuda_graph_scope="moe_router")
    model = build_model(cfg, trace_spec(stock_spec(cfg), tc))
    tokens, pos, mask, _ = batch()
    with trace_guidance(model, None) as h, torch.no_grad():
        model(tokens, pos, mask)
    assert dict(h.counter.fallback) == {"not_guided_layer": 2 * 2 * T, "missing": 2 * 2 * T}  # (2 sites, 2 + 2 layers)
