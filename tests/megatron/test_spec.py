"""Spec provider and spec conversion: TRACE disabled is Megatron bit for bit; enabled swaps only experts + attention."""

import pytest
import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import (
    TraceDotProductAttention,
    TraceSequentialMLP,
    TraceSpecProvider,
    get_trace_decoder_block_spec,
    get_trace_gpt_layer_spec,
    trace_spec,
)

from .harness import EXPERTS, batch, build_model, logits, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")


def test_disabled_returns_megatrons_spec_and_bit_identical_logits():
    cfg = tiny_config()
    stock = stock_spec(cfg)
    off = TraceConfig(enabled=False)
    assert trace_spec(stock, off) is stock
    block = get_trace_decoder_block_spec(off, cfg, normalization="RMSNorm")
    a, b = build_model(cfg, stock), build_model(cfg, block)
    data = batch()
    assert torch.equal(logits(a, data), logits(b, data))


def test_enabled_changes_only_experts_and_core_attention():
    cfg = tiny_config()
    stock, model = build_model(cfg, stock_spec(cfg)), build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig()))
    sd_a, sd_b = stock.state_dict(), model.state_dict()
    assert sorted(sd_a) == sorted(sd_b)  # same parameter names: checkpoints and bridges keep working
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a if torch.is_tensor(sd_a[k]))  # same init
    for la, lb in zip(stock.decoder.layers, model.decoder.layers):
        assert type(lb.mlp) is MoELayer and type(lb.mlp.router) is type(la.mlp.router)
        assert type(la.mlp.experts) is SequentialMLP and type(lb.mlp.experts) is TraceSequentialMLP
        assert type(la.self_attention.core_attention) is DotProductAttention
        assert type(lb.self_attention.core_attention) is TraceDotProductAttention
        assert type(lb.self_attention.linear_qkv) is type(la.self_attention.linear_qkv)


def test_layer_ids_include_megatrons_numbering():
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig()))
    from megatron_trace.megatron import find_trace_layers

    layers = find_trace_layers(model)
    assert sorted(layers.moe) == sorted(layers.kv) == [0, 1, 2, 3]
    assert all(layers.moe[i] is model.decoder.layers[i].mlp for i in range(4))


def test_kv_only_config_keeps_megatrons_experts():
    cfg = tiny_config()
    tc = TraceConfig(sites=("kv_k", "kv_v"), guided_sites=("kv_k", "kv_v"))
    layer = trace_spec(stock_spec(cfg), tc).layer_specs[0]
    assert layer.submodules.mlp.submodules.experts.module is SequentialMLP
    assert layer.submodules.self_attention.submodules.core_attention.module is TraceDotProductAttention


def test_provider_falls_back_for_everything_else():
    tc = TraceConfig()
    p, local = TraceSpecProvider(tc), LocalSpecProvider()
    assert p.column_parallel_linear() is local.column_parallel_linear()
    assert p.row_parallel_linear() is local.row_parallel_linear()
    assert p.layer_norm(rms_norm=True) is local.layer_norm(rms_norm=True)
    assert p.fuse_layernorm_and_linear() is False
    assert p.core_attention().module is TraceDotProductAttention
    assert p.core_attention().params["trace_config"] is tc
    module, sub = p.grouped_mlp_modules(False, False)  # bound to tc: Megatron's helper gives it no params
    assert issubclass(module, TraceSequentialMLP) and sub.linear_fc1 is ColumnParallelLinear
    moe = p.moe_module_spec(num_experts=EXPERTS)
    assert moe.module is MoELayer and moe.submodules.experts.module is TraceSequentialMLP
    assert moe.submodules.experts.params == {"trace_config": tc}


def test_legacy_grouped_gemm_maps_to_the_sequential_layout():
    module, sub = TraceSpecProvider(TraceConfig()).experts_module(GroupedMLP, None)
    assert module is TraceSequentialMLP
    assert (sub.linear_fc1, sub.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)


def test_layer_spec_helper_and_block_spec_share_converted_layers():
    tc = TraceConfig()
    layer = get_trace_gpt_layer_spec(tc, num_experts=EXPERTS, normalization="RMSNorm")
    assert layer.submodules.mlp.submodules.experts.module is TraceSequentialMLP
    block = get_trace_decoder_block_spec(tc, tiny_config(), normalization="RMSNorm")
    assert isinstance(block, TransformerBlockSubmodules)
    assert len({id(s) for s in block.layer_specs}) == 1  # one shared layer spec, converted once


def test_bad_spec_type_is_rejected():
    with pytest.raises(TypeError, match="ModuleSpec or TransformerBlockSubmodules"):
        trace_spec(object(), TraceConfig())
    with pytest.raises(TypeError, match=r"trace_config must be a TraceConfig \(TraceConfig.from_dict for a dict\), "
                                        "got dict"):  # (was: 'dict' object has no attribute 'enabled')
        trace_spec(object(), {"format": "nvfp4"})


@pytest.mark.usefixtures("world1")
def test_provider_as_a_backend_of_megatrons_own_spec_helper_builds_trace_experts():
    """``get_moe_module_spec_for_backend(backend=TraceSpecProvider(tc))`` builds the experts' ModuleSpec without
    params: the class the provider gives carries ``tc`` itself."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    tc = TraceConfig(guided_layers="all")
    spec = get_moe_module_spec_for_backend(backend=TraceSpecProvider(tc), num_experts=EXPERTS)
    assert spec.submodules.experts.params == {}
    moe = build_module(spec, config=tiny_config(), pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    assert isinstance(moe.experts, TraceSequentialMLP) and moe.experts.trace_config is tc


class _Marked(LocalSpecProvider):
    """Megatron's local provider with answers of its own (as TE's differ from the local ones), and the grouped-GEMM
    flags it was asked with."""

    class QKNorm(torch.nn.Module):
        pass

    class Activation(torch.nn.Module):
        pass

    class NormLinear(torch.nn.Module):
        pass

    def __init__(self):
        self.asked = []

    def layer_norm(self, rms_norm=False, for_qk=False):
        return self.QKNorm if for_qk else super().layer_norm(rms_norm=rms_norm)

    def activation_func(self):
        return self.Activation

    def column_parallel_layer_norm_linear(self):
        return self.NormLinear

    def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
        self.asked.append((moe_use_grouped_gemm, moe_use_legacy_grouped_gemm))
        return super().grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)


def test_provider_passes_every_question_to_its_fallback():
    fallback = _Marked()
    p = TraceSpecProvider(TraceConfig(), fallback)
    assert p.layer_norm(rms_norm=True, for_qk=True) is _Marked.QKNorm
    assert p.layer_norm(rms_norm=True) is fallback.layer_norm(rms_norm=True)
    assert p.activation_func() is _Marked.Activation
    assert p.column_parallel_layer_norm_linear() is _Marked.NormLinear
    p.moe_module_spec(num_experts=EXPERTS, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
    assert fallback.asked == [(True, True)]


def test_a_disabled_provider_gives_megatrons_modules():
    """As a backend of Megatron's own spec helpers with TRACE off: Megatron's experts and core attention."""
    p, local = TraceSpecProvider(TraceConfig(enabled=False)), LocalSpecProvider()
    assert p.core_attention() is local.core_attention()
    assert p.grouped_mlp_modules(False, False)[0] is SequentialMLP
    assert p.moe_module_spec(num_experts=EXPERTS).submodules.experts.module is SequentialMLP


def test_conversion_keeps_the_stock_specs_params_and_submodules():
    """A stock spec's own params and linear classes (TE's, in Megatron's TE spec) survive the conversion."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    class Fc1(ColumnParallelLinear):
        pass

    class Fc2(RowParallelLinear):
        pass

    tc = TraceConfig()
    p = TraceSpecProvider(tc)
    sub = MLPSubmodules(linear_fc1=Fc1, linear_fc2=Fc2)
    experts = p.experts_spec(ModuleSpec(module=SequentialMLP, params={"extra": 1}, submodules=sub))
    assert experts.module is TraceSequentialMLP and experts.submodules is sub
    assert experts.params == {"extra": 1, "trace_config": tc}
    attention = p.core_attention_spec(ModuleSpec(module=DotProductAttention, params={"softmax_scale": 0.5}))
    assert attention.module is TraceDotProductAttention
    assert attention.params == {"softmax_scale": 0.5, "trace_config": tc}


@pytest.mark.parametrize("pp_rank,vp_stage", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_decoder_block_spec_is_megatrons_stage_converted(pp_rank, vp_stage):
    """The pipeline stage's slice (pp_rank, vp_stage) and the q/k norm of Megatron's block spec, converted."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = tiny_config()
    cfg.num_layers, cfg.moe_layer_freq, cfg.qk_layernorm = 8, [1, 0, 0, 1, 1, 1, 0, 0], True
    cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size = 2, 2
    tc, kw = TraceConfig(), dict(normalization="RMSNorm", qk_l2_norm=True, pp_rank=pp_rank, vp_stage=vp_stage)
    want = trace_spec(get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, **kw), tc)
    got = get_trace_decoder_block_spec(tc, cfg, **kw)
    assert got.layer_specs == want.layer_specs and len(got.layer_specs) == 2


def _mla_block_spec():
    """Megatron's local decoder block spec of a small MLA MoE model (DeepSeek-V3's attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = MLATransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=64, moe_ffn_hidden_size=64, num_attention_heads=4,
        num_moe_experts=EXPERTS, moe_router_topk=2, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope", normalization="RMSNorm",
        add_bias_linear=False, use_cpu_initialization=True)
    return get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")


def test_multi_latent_attention_converts_its_experts_and_refuses_kv_sites():
    """DeepSeek-V3's MLA: the rollout caches the latent row, TRACE's KV sites would round the decompressed per-head
    K/V, which no rollout computes. Refused, naming the sites and the fix; with the experts only the spec converts
    and MLA's core attention stays Megatron's. (Megatron-Core 0.16.1's local MLA spec needs TE's core attention to
    build a model, so only the specs are checked here.)"""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    stock = _mla_block_spec()
    assert stock.layer_specs[0].submodules.self_attention.module is MLASelfAttention
    with pytest.raises(ValueError, match=r"KV sites \['kv_k', 'kv_v'\].*MLASelfAttention.*TraceConfig\(sites="
                                         r"\('expert_fc1_in', 'expert_fc2_in', 'weights'\), guided_sites="
                                         r"\('expert_fc1_in', 'expert_fc2_in'\)\)"):
        trace_spec(stock, TraceConfig())
    with pytest.raises(ValueError, match=r"KV sites \['kv_v'\]"):
        trace_spec(stock, TraceConfig(sites=("weights", "kv_v"), guided_sites=()))
    experts_only = TraceConfig(sites=("expert_fc1_in", "expert_fc2_in", "weights"),
                               guided_sites=("expert_fc1_in", "expert_fc2_in"))
    for layer, before in zip(trace_spec(stock, experts_only).layer_specs, stock.layer_specs):
        assert layer.submodules.mlp.submodules.experts.module is TraceSequentialMLP
        core = layer.submodules.self_attention.submodules.core_attention
        assert core == before.submodules.self_attention.submodules.core_attention  # Megatron's, unchanged


def test_multi_latent_attention_refusal_names_a_config_that_quantizes_the_experts():
    """The MLA refusal's fix is a config that converts the experts: with only KV sites the user's sites less K/V
    are none (that quantizes nothing, and Megatron-LM refuses an empty --trace-sites), so the expert sites are named;
    a ``kv_format`` is dropped with the KV sites (Megatron-LM refuses --trace-kv-format without a KV site)."""
    from megatron_trace.config import ACTIVATION_SITES, SITES

    stock = _mla_block_spec()
    experts = (r"TraceConfig\(sites=\('expert_fc1_in', 'expert_fc2_in', 'weights'\), "
               r"guided_sites=\('expert_fc1_in', 'expert_fc2_in'\)\)")
    with pytest.raises(ValueError, match=experts + r" \(Megatron-LM: --trace-sites expert_fc1_in,expert_fc2_in,"
                                                   r"weights\)"):
        trace_spec(stock, TraceConfig(sites=("kv_k", "kv_v"), guided_sites=("kv_k", "kv_v")))
    with pytest.raises(ValueError, match=r"TraceConfig\(sites=\('weights',\), guided_sites=\(\)\)"):
        trace_spec(stock, TraceConfig(sites=("weights", "kv_k"), guided_sites=("kv_k",)))
    with pytest.raises(ValueError, match=r"guided_sites=\('expert_fc1_in', 'expert_fc2_in'\), kv_format=''\) "
                                         r"\(Megatron-LM: --trace-sites expert_fc1_in,expert_fc2_in,weights, without "
                                         r"--trace-kv-format\)"):
        trace_spec(stock, TraceConfig(kv_format="sglang_kvfp4", sites=SITES, guided_sites=ACTIVATION_SITES))
    fixed = TraceConfig(sites=("expert_fc1_in", "expert_fc2_in", "weights"),
                        guided_sites=("expert_fc1_in", "expert_fc2_in"))
    for layer in trace_spec(stock, fixed).layer_specs:
        assert layer.submodules.mlp.submodules.experts.module is TraceSequentialMLP


@pytest.mark.parametrize("guided", ["expert_fc1_in,kv_k", "kv_k,kv_v", None])
def test_multi_latent_attention_refusal_names_megatron_flags_that_pass(guided):
    """The refusal's Megatron-LM flags, in place of the user's --trace-sites and --trace-guided-sites, give a config
    the MLA spec takes with the guided sites the TraceConfig named: with a KV site in --trace-guided-sites, naming
    --trace-sites alone left it there, which the config refuses (not a quantized site)."""
    import argparse
    import re
    import shlex

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_trace.megatron.args import add_trace_args, trace_config_from_args
    from megatron_trace.megatron.spec import _refuse_latent_kv

    def config(flags: dict) -> TraceConfig:
        argv = ["--trace-fp4"] + [x for k, v in flags.items() for x in (k, v)]
        return trace_config_from_args(add_trace_args(argparse.ArgumentParser()).parse_args(argv))

    given = {"--trace-sites": "expert_fc1_in,expert_fc2_in,weights,kv_k,kv_v"}
    if guided is not None:
        given["--trace-guided-sites"] = guided
    with pytest.raises(ValueError, match="Megatron-LM") as e:
        _refuse_latent_kv(MLASelfAttention, config(given))
    named = re.search(r"guided_sites=(\(.*?\))", str(e.value)).group(1)
    hint = shlex.split(re.search(r"\(Megatron-LM: (.*)\)$", str(e.value)).group(1))
    cfg = config({**given, **dict(zip(hint[::2], hint[1::2]))})
    _refuse_latent_kv(MLASelfAttention, cfg)  # (no KV site left: taken)
    assert str(cfg.guided_sites) == named
