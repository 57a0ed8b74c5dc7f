"""Issue 11 item 2, ``TraceConfig.exclude_modules``: boundary layers kept in BF16 (NeMo-RL#3426) on both sides,
reported as such, and a pattern that matches no module is an error (NeMo-RL#3614's silent no-op)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_trace.config import KV_SITES, TraceConfig
from megatron_trace.manifest import (
    EXPERT_SITES,
    ModulePatternError,
    RecipeMismatchError,
    check_module_sets,
    check_recipe,
    experts_name,
    kv_cache_name,
    trainer_quantized_modules,
    trainer_recipe,
)
from megatron_trace.megatron import StepGuidance, find_trace_layers, trace_guidance, trace_record, trace_spec
from megatron_trace.megatron.args import add_trace_args, trace_args_from_config, trace_config_from_args
from megatron_trace.megatron.attention import TraceKVCore
from megatron_trace.megatron.experts import TraceExpertsCore
from megatron_trace.rollout import HFRolloutBackend, SamplingParams

from ..megatron.harness import LAYERS, batch, build_model, mtp_spec, stock_spec
from ..megatron.harness import tiny_config as megatron_config
from ..rollout._tiny import tiny_config, tiny_model

CFG = TraceConfig(guided_layers="all")
EXPERTS0 = "model.layers.0.mlp.experts"
NO_EXPERTS0 = CFG.replace(exclude_modules=(EXPERTS0,))
NO_LAYER0 = CFG.replace(exclude_modules=("model.layers.0.*",))  # experts and KV cache of layer 0


def _hf(config=CFG, mode="fp4", dtype=torch.float32, **hf_kw):
    return HFRolloutBackend(tiny_model(tiny_config(num_hidden_layers=LAYERS, **hf_kw)), mode=mode,
                            trace_config=config, dtype=dtype)


def _model(config=CFG, **mcfg):
    cfg = megatron_config(**mcfg)
    return build_model(cfg, trace_spec(stock_spec(cfg), config))


def _trainer(config=CFG, **mcfg):
    return find_trace_layers(_model(config, **mcfg))


def _same_fp4(a, b) -> bool:
    same_amax = (a.global_amax is None and b.global_amax is None) or torch.equal(a.global_amax, b.global_amax)
    return (torch.equal(a.codes, b.codes) and same_amax
            and torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8)))


@pytest.mark.usefixtures("world1")
def test_excluding_layer0_experts_on_both_sides_agrees_and_leaves_other_codes_alone():
    layers, be = _trainer(NO_EXPERTS0), _hf(NO_EXPERTS0)
    quant, audit = trainer_quantized_modules(layers), be.module_audit()
    assert quant == audit.quantized and EXPERTS0 not in quant and EXPERTS0 in audit.bf16
    assert "model.layers.0.self_attn.kv_cache" in quant  # only what the pattern names
    check_recipe(trainer_recipe(layers), _hf(NO_EXPERTS0, dtype=torch.bfloat16).recipe())  # (the trainer's dtype)

    # rollout: layer 0 keeps its BF16 weights (no FP4 codes); every other layer's codes are unchanged
    base, raw = _hf(), tiny_model(tiny_config(num_hidden_layers=LAYERS))
    for e in range(be.hf_config.num_experts):
        for which in ("fc1", "fc2"):
            for layer in range(1, LAYERS):
                assert _same_fp4(be.expert_weight_fp4(layer, e, which), base.expert_weight_fp4(layer, e, which))
            with pytest.raises(KeyError, match="layer=0"):
                be.expert_weight_fp4(0, e, which)
    ours, orig = be.model.model.layers[0].mlp.experts, raw.model.layers[0].mlp.experts
    assert torch.equal(ours.gate_up_proj, orig.gate_up_proj) and torch.equal(ours.down_proj, orig.down_proj)

    # trainer: layer 0's experts use their weights as they are; the others' fake-quantized weights are unchanged
    full = find_trace_layers(_model())
    for layer in range(LAYERS):
        ex, fq = layers.moe[layer].experts, full.moe[layer].experts
        for name in ("linear_fc1", "linear_fc2"):
            raw_w = torch.stack([getattr(m, name).weight for m in ex.local_experts])
            assert torch.equal(raw_w, torch.stack([getattr(m, name).weight for m in fq.local_experts]))
            if layer == 0:
                assert torch.equal(ex._stacked(name), raw_w) and not torch.equal(fq._stacked(name), raw_w)
            else:
                assert torch.equal(ex._stacked(name), fq._stacked(name))


@pytest.mark.usefixtures("world1")
def test_excluding_on_one_side_only_fires_naming_the_module():
    with pytest.raises(RecipeMismatchError, match=r"only in rollout \['model.layers.0.mlp.experts'\] \(1\)"):
        check_module_sets(trainer_quantized_modules(_trainer(NO_EXPERTS0)), _hf().module_audit().quantized)
    kv3 = CFG.replace(exclude_modules=("model.layers.3.self_attn.kv_cache",))
    layers, be = _trainer(), _hf(kv3)
    assert "model.layers.3.self_attn.kv_cache" in be.module_audit().bf16
    with pytest.raises(RecipeMismatchError, match=r"only in trainer \['model.layers.3.self_attn.kv_cache'\] \(1\)"):
        check_module_sets(trainer_quantized_modules(layers), be.module_audit().quantized)
    with pytest.raises(RecipeMismatchError, match="quantized_modules: trainer="):
        check_recipe(trainer_recipe(layers), be.recipe())


@pytest.mark.usefixtures("world1")
def test_a_pattern_matching_no_module_is_an_error_on_both_sides():
    typo = CFG.replace(exclude_modules=(EXPERTS0, "layers.0.mlp.experts"))  # without the 'model.' prefix
    msg = "TraceConfig.exclude_modules pattern 'layers.0.mlp.experts' matches none"
    with pytest.raises(ModulePatternError, match=msg):
        _hf(typo)
    with pytest.raises(ModulePatternError, match=msg):
        _hf(typo, mode="bf16")  # the BF16 baseline validates the same config
    with pytest.raises(ModulePatternError, match=msg):
        _trainer(typo)
    # a dense layer has no routed experts to exclude
    with pytest.raises(ModulePatternError, match="'model.layers.0.mlp.experts' matches none"):
        _trainer(NO_EXPERTS0, moe_layer_freq=[0, 1, 1, 1])
    with pytest.raises(ModulePatternError, match="'model.layers.0.mlp.experts' matches none"):
        _hf(NO_EXPERTS0, mlp_only_layers=[0])
    # KV caches are candidates only when a KV site is quantized
    with pytest.raises(ModulePatternError, match=r"'model.layers.\*.self_attn.kv_cache' matches none"):
        _hf(TraceConfig(sites=("expert_fc1_in", "weights"), guided_sites=(),
                        exclude_modules=("model.layers.*.self_attn.kv_cache",)))


EXPERT_ONLY = TraceConfig(sites=("expert_fc1_in", "expert_fc2_in", "weights"),
                          guided_sites=("expert_fc1_in", "expert_fc2_in"))
LAST2_EXCLUDED = EXPERT_ONLY.replace(guided_layers="last_k", guided_last_k=2,
                                     exclude_modules=("model.layers.2.mlp.experts", "model.layers.3.mlp.experts"))


@pytest.mark.usefixtures("world1")
def test_guided_layers_whose_modules_are_all_excluded_are_an_error_on_every_side():
    """The policy's layers are all kept in BF16: each side used to list them as guided (the recipes agreed) and
    record / guide nothing there, silently (the hf backend's guided sites and the SGLang specs were empty)."""
    import argparse

    from megatron_trace.rollout.sglang.launch import guidance_specs

    msg = r"guided_layers='last_k' picks layer\(s\) \[2, 3\], which would guide nothing.*model.layers.2.mlp.experts"
    with pytest.raises(ValueError, match=msg):
        _hf(LAST2_EXCLUDED)
    with pytest.raises(ValueError, match=msg):
        guidance_specs(LAST2_EXCLUDED, tiny_config(num_hidden_layers=LAYERS).to_dict(), kv_dtype="auto")
    with pytest.raises(ValueError, match=msg):
        _trainer(LAST2_EXCLUDED)
    args = add_trace_args(argparse.ArgumentParser()).parse_args(
        ["--trace-fp4", *trace_args_from_config(LAST2_EXCLUDED)])
    args.num_layers, args.num_experts, args.moe_layer_freq = LAYERS, 8, 1
    with pytest.raises(ValueError, match="--trace-guided-layers with --trace-exclude-modules: .*" + msg):
        trace_config_from_args(args)
    # an explicit layer whose modules are excluded (or dense) is named, though the other listed layers guide
    one = EXPERT_ONLY.replace(guided_layers="explicit", guided_layer_list=(1, 3),
                             exclude_modules=("model.layers.3.*",))
    with pytest.raises(ValueError, match=r"guided_layer_list has layer\(s\) \[3\], which would guide nothing"):
        _hf(one)
    with pytest.raises(ValueError, match=r"guided_layer_list has layer\(s\) \[3\]"):
        _trainer(one)
    # one guided layer left with a module: guided, not an error (the policy still guides layer 2)
    ok = LAST2_EXCLUDED.replace(exclude_modules=("model.layers.3.mlp.experts",))
    be, layers = _hf(ok, dtype=torch.bfloat16), _trainer(ok)
    assert be.guided_sites == {(2, "expert_fc1_in"), (2, "expert_fc2_in")}
    check_recipe(trainer_recipe(layers), be.recipe())


def test_pattern_syntax_is_checked_by_the_config():
    for bad in ("", "model.layers.[0].mlp.experts", "model.layers.0.mlp.experts ", "model.layers.?"):
        with pytest.raises(ValueError, match="TraceConfig.exclude_modules has"):
            TraceConfig(exclude_modules=(bad,))
    with pytest.raises(ValueError, match="must be a list \\(not one string\\)"):
        TraceConfig(exclude_modules=EXPERTS0)
    assert TraceConfig.from_dict({"exclude_modules": [EXPERTS0]}).exclude_modules == (EXPERTS0,)


def test_launch_flags_round_trip_the_patterns():
    import argparse

    cfg = TraceConfig(exclude_modules=(EXPERTS0, "model.layers.3.*"))
    args = add_trace_args(argparse.ArgumentParser()).parse_args(trace_args_from_config(cfg))
    assert trace_config_from_args(args) == cfg


def _experts_reference(x, idx, w, gate_up, down):
    """The BF16 (model dtype) experts: sum_k w_k * down_e(silu(gate_e x) * up_e x), token by token."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, k] * (down[e] @ (F.silu(gate) * up))
    return out


def test_rollout_excluded_layer_runs_in_the_model_dtype():
    be = _hf(NO_LAYER0)
    assert be.bf16_expert_layers == {0} and be.bf16_kv_layers == {0}
    g = torch.Generator().manual_seed(0)
    n, h = 12, be.hf_config.hidden_size
    x = torch.randn(n, h, generator=g)
    idx = torch.stack([torch.randperm(be.hf_config.num_experts, generator=g)[:2] for _ in range(n)])
    w = torch.softmax(torch.randn(n, 2, generator=g), -1)
    with be.forward_context() as model:
        outs = {i: model.model.layers[i].mlp.experts(x, idx, w) for i in (0, 1)}
    for i, out in outs.items():
        m = be.model.model.layers[i].mlp.experts
        ref = _experts_reference(x, idx, w, m.gate_up_proj, m.down_proj)  # layer 1: dequantized FP4 weights
        if i == 0:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:  # FP4 activations: far from the unquantized computation
            assert (out - ref).abs().max() > 1e-3
    cache = be.new_cache()
    assert [(c.quantize_k, c.quantize_v) for c in cache.layers] == [(False, False)] + [(True, True)] * (LAYERS - 1)
    batch_out = be.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=3, seed=0))
    assert {k[0] for k in batch_out.guidance} == set(range(1, LAYERS)) and 0 in batch_out.routing


@pytest.mark.usefixtures("world1")
def test_trainer_excluded_layer_runs_in_the_model_dtype():
    model = _model(NO_LAYER0)
    with pytest.raises(RuntimeError, match="call megatron_trace.megatron.find_trace_layers"):
        model(*batch()[:3])  # before the experts know their layer, exclusion cannot be applied
    layers = find_trace_layers(model)
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 2, 1, 2, 1, 0, 3])
    x = torch.randn(int(counts.sum()), 64, generator=g).bfloat16()
    probs = torch.rand(x.shape[0], generator=g).bfloat16()
    for layer in (0, 1):
        ex = layers.moe[layer].experts
        with torch.no_grad():
            out, _ = ex(x, counts, probs)
            ref = torch.cat([
                F.linear(ex._activation(F.linear(xe, m.linear_fc1.weight)), m.linear_fc2.weight)
                for xe, m in zip(torch.split(x, counts.tolist()), ex.local_experts)
            ]) * probs.unsqueeze(-1)
        assert torch.equal(out, ref) == (layer == 0)
    kv = torch.randn(5, 2, 2, 16, generator=g).bfloat16()  # [S, B, kv_heads, head_dim]
    assert torch.equal(layers.kv[0].quantize_kv("kv_k", kv), kv)
    assert not torch.equal(layers.kv[1].quantize_kv("kv_k", kv), kv)
    # under trace_guidance the excluded layer records routing but no guidance, and its rows are not counted
    with trace_record(model) as rec, torch.no_grad():
        model(*batch()[:3])
    got = rec.recorded()
    assert {k[0] for k in got.sites} == set(range(1, LAYERS)) and set(got.routing) == set(range(LAYERS))
    assert not any(k[0] == 0 for k in rec.stats())
    with trace_guidance(model, got) as h, torch.no_grad():
        model(*batch()[:3])
    assert h.coverage() == 1.0 and h.counter.used > 0


def test_fp4_sync_sends_excluded_layers_in_bf16():
    from megatron_trace.bridge.sync import fp4_stream
    from megatron_trace.formats import FP4Tensor, Quantizer

    w = torch.randn(64, 32)
    named = [(f"model.layers.{layer}.mlp.experts.0.{p}.weight", w) for layer in (0, 1)
             for p in ("gate_proj", "up_proj", "down_proj")]
    out = dict(fp4_stream(named, Quantizer(), bf16_layers={0}))
    assert all(not isinstance(v, FP4Tensor) and v.dtype == torch.bfloat16 for k, v in out.items() if ".layers.0." in k)
    assert all(isinstance(v, FP4Tensor) for k, v in out.items() if ".layers.1." in k)


def _quantizing_modules(model) -> tuple[str, ...]:
    """What the model's modules quantize, by walking all of them (MTP layers included): the canonical name of every
    TRACE experts / attention module that quantizes a site, by its layer id."""
    names = set()
    for m in model.modules():
        if isinstance(m, TraceExpertsCore) and any(map(m.trace_quantizes, EXPERT_SITES)):
            names.add(experts_name(m.trace_layer))
        elif isinstance(m, TraceKVCore) and any(map(m.trace_quantizes, KV_SITES)):
            names.add(kv_cache_name(m.layer_number - 1))
    return tuple(sorted(names))


def _mtp_model(mtp: int, config: TraceConfig, *, trace_mtp: bool):
    """A model with ``mtp`` MTP layers: of the stock spec (as the Megatron-LM patch builds them), or of trace_spec's."""
    cfg = megatron_config(mtp_num_layers=mtp)
    spec = trace_spec(stock_spec(cfg), config)
    return build_model(cfg, spec, mtp_block_spec=mtp_spec(cfg, spec.layer_specs[-1] if trace_mtp else None))


SITE_SETS = {"experts": EXPERT_ONLY, "kv": CFG.replace(sites=KV_SITES, guided_sites=KV_SITES), "both": CFG}


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("mtp", [1, 2])
@pytest.mark.parametrize("sites", SITE_SETS)
def test_trace_modules_in_mtp_layers_are_refused_by_name(mtp, sites):
    """MTP layers built from trace_spec's layer spec fake-quantized their experts and K/V in FP4 with no trace in the
    module audit (``trainer_quantized_modules``: the decoder's only), no name ``exclude_modules`` accepted (their layer
    ids are past the decoder's), no guidance and NaN/Inf counters nobody read. MTP layers keep the stock spec (the
    Megatron-LM patch's): a TRACE module there is refused, naming it, by every entry point."""
    model = _mtp_model(mtp, SITE_SETS[sites], trace_mtp=True)
    n = mtp * (sites == "both") + mtp
    msg = (rf"TRACE modules in multi-token-prediction layers: \[.*'mtp\.layers\.{mtp - 1}\.transformer_layer\..*"
           rf"\({n}\)\. MTP layers keep Megatron's stock spec")
    with pytest.raises(ValueError, match=msg):
        find_trace_layers(model)
    with pytest.raises(ValueError, match=msg), trace_guidance(model, StepGuidance()):
        pass


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("mtp", [1, 2])
@pytest.mark.parametrize("sites", SITE_SETS)
def test_with_stock_mtp_layers_the_audit_is_what_the_model_quantizes(mtp, sites):
    """With MTP layers of the stock spec, the audit lists exactly what the model's modules quantize (a walk of all of
    them), with or without a decoder layer excluded; an MTP layer's id (4) names nothing to exclude; the model runs
    (with its experts' layer ids bound: exclude_modules needs them)."""
    for exclude in ((), ("model.layers.0.*",)):
        model = _mtp_model(mtp, SITE_SETS[sites].replace(exclude_modules=exclude), trace_mtp=False)
        layers = find_trace_layers(model)
        assert trainer_quantized_modules(layers) == _quantizing_modules(model)
        assert len(_quantizing_modules(model)) == (LAYERS - bool(exclude)) * (1 + (sites == "both"))
    model.eval()  # (Megatron's MTP loss tracker is sized by the first model of the process)
    tokens, pos, mask, labels = batch(b=1, s=8)
    with trace_guidance(model, StepGuidance()), torch.no_grad():
        assert torch.isfinite(model(tokens, pos, mask, labels=labels)).all()
    with pytest.raises(ModulePatternError, match=r"pattern 'model.layers.4.\*' matches none"):
        find_trace_layers(_mtp_model(mtp, SITE_SETS[sites].replace(exclude_modules=("model.layers.4.*",)),
                                     trace_mtp=False))
