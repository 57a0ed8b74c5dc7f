"""Issue 11 item 2: both sides list the modules they quantize (canonical HF names); the sets must be equal;
patterns that match nothing are errors; dense layers, shared experts, router, embeddings and lm_head are
reported BF16."""

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

from megatron_trace.bridge import fp4_stream
from megatron_trace.config import TraceConfig
from megatron_trace.export.modelopt import build_modelopt_state, exclude_modules_of
from megatron_trace.manifest import (
    ModulePatternError,
    RecipeMismatchError,
    check_module_sets,
    check_recipe,
    match_modules,
    quantized_module_names,
    trainer_quantized_modules,
    trainer_recipe,
)
from megatron_trace.megatron import find_trace_layers, trace_spec
from megatron_trace.rollout import HFRolloutBackend
from megatron_trace.rollout.audit import hf_module_audit, qwen3_moe_modules, sglang_module_audit, without_kv
from megatron_trace.rollout.hf_weights import checkpoint_tensors

from ..megatron.harness import LAYERS, build_model, stock_spec
from ..megatron.harness import tiny_config as megatron_config
from ..rollout._tiny import tiny_config, tiny_model

CFG = TraceConfig(guided_layers="last_k", guided_last_k=2)


def _hf(config=CFG, dtype=torch.float32, **hf_kw):
    return HFRolloutBackend(tiny_model(tiny_config(num_hidden_layers=LAYERS, **hf_kw)), mode="fp4",
                            trace_config=config, dtype=dtype)


def _trainer(config=CFG, **mcfg):
    cfg = megatron_config(**mcfg)
    return find_trace_layers(build_model(cfg, trace_spec(stock_spec(cfg), config)))


@pytest.mark.usefixtures("world1")
def test_trainer_and_hf_rollout_quantize_the_same_modules():
    layers, be = _trainer(), _hf(dtype=torch.bfloat16)  # (the harness trainer is bf16: the recipe's dtype)
    quant = trainer_quantized_modules(layers)
    assert quant == be.module_audit().quantized
    assert quant == tuple(sorted([f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
                                 + [f"model.layers.{i}.self_attn.kv_cache" for i in range(LAYERS)]))
    check_recipe(trainer_recipe(layers), be.recipe())  # the whole manifest agrees too


@pytest.mark.usefixtures("world1")
def test_a_layer_quantized_on_one_side_only_fires():
    """The trainer's layer 0 is dense (BF16 MLP), the rollout's is MoE in FP4: the audit names that layer."""
    layers, be = _trainer(moe_layer_freq=[0, 1, 1, 1]), _hf()
    with pytest.raises(RecipeMismatchError, match=r"only in rollout \['model.layers.0.mlp.experts'\] \(1\)"):
        check_module_sets(trainer_quantized_modules(layers), be.module_audit().quantized)
    with pytest.raises(RecipeMismatchError, match="quantized_modules: trainer="):
        check_recipe(trainer_recipe(layers), be.recipe())
    same = _hf(mlp_only_layers=[0])  # a rollout with the same dense layer agrees
    check_module_sets(trainer_quantized_modules(layers), same.module_audit().quantized)


@pytest.mark.usefixtures("world1")
def test_a_hybrid_model_with_expert_sites_only_has_one_recipe():
    """A dense layer 0 and no KV site: the guided layers are the policy's on both sides (layer 0 included, though
    it has no site to guide), so the recipes agree."""
    cfg = TraceConfig(sites=("expert_fc1_in", "expert_fc2_in", "weights"),
                      guided_sites=("expert_fc1_in", "expert_fc2_in"), guided_layers="all")
    layers, be = _trainer(cfg, moe_layer_freq=[0, 1, 1, 1]), _hf(cfg, torch.bfloat16, mlp_only_layers=[0])
    assert be.recipe().guided_layers == trainer_recipe(layers).guided_layers == tuple(range(LAYERS))
    check_recipe(trainer_recipe(layers), be.recipe())
    assert not any(layer == 0 for layer, _ in be.guided_sites)


def test_dense_router_embeddings_and_lm_head_are_reported_bf16():
    audit = _hf(mlp_only_layers=[0]).module_audit()
    bf16 = set(audit.bf16)
    assert {"model.embed_tokens", "lm_head", "model.layers.1.mlp.gate", "model.layers.0.mlp.gate_proj",
            "model.layers.0.mlp.down_proj", "model.layers.2.self_attn.q_proj", "model.norm"} <= bf16
    assert not any(".experts" in n for n in bf16) and "model.layers.0.mlp.experts" not in audit.quantized
    assert not bf16 & set(audit.quantized)
    moe, linear = qwen3_moe_modules(tiny_config(num_hidden_layers=LAYERS, mlp_only_layers=[0]).to_dict())
    assert moe == (1, 2, 3) and set(linear) == {n for n in bf16 if "norm" not in n}


def test_shared_experts_stay_bf16():
    c = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])
    audit = hf_module_audit(Qwen2MoeForCausalLM(c), CFG, moe_layers=[1], num_layers=2)
    assert audit.quantized == ("model.layers.0.self_attn.kv_cache", "model.layers.1.mlp.experts",
                               "model.layers.1.self_attn.kv_cache")
    shared = {f"model.layers.1.mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}
    assert shared | {"model.layers.1.mlp.shared_expert_gate"} <= set(audit.bf16)
    moe, linear = qwen3_moe_modules(c.to_dict())
    assert moe == (1,) and set(linear) == {n for n in audit.bf16 if "norm" not in n}


def test_sglang_exclude_patterns_are_audited():
    """The checkpoint's exclude list decides which Linears SGLang serves in FP4: exported lists agree with the
    trainer; a list that misses an attention projection puts it into the quantized set (the audit fires); a
    pattern that matches nothing as SGLang matches is an error, not a silent no-op."""
    cfg, hf = without_kv(CFG), tiny_config(num_hidden_layers=LAYERS)
    exported = exclude_modules_of(n for n, t in checkpoint_tensors(tiny_model(hf))
                                  if ".experts." not in n and t.dim() == 2)  # as export.modelopt writes it
    trainer = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    check_module_sets(trainer, sglang_module_audit(cfg, hf.to_dict(), exported).quantized)
    check_module_sets(trainer, sglang_module_audit(cfg, hf.to_dict(), ["self_attn", "lm_head"]).quantized)
    no_o = [p for p in exported if p != "model.layers.0.self_attn.o_proj"]
    with pytest.raises(RecipeMismatchError, match=r"only in rollout \['model.layers.0.self_attn.o_proj'"):
        check_module_sets(trainer, sglang_module_audit(cfg, hf.to_dict(), no_o).quantized)
    with pytest.raises(ModulePatternError, match="'layers.0.mlp.gates' matches none"):
        sglang_module_audit(cfg, hf.to_dict(), [*exported, "layers.0.mlp.gates"])


def test_sglang_audit_reads_exclude_entries_as_sglang_does():
    """SGLang 0.5.10 (modelopt_quant.is_layer_excluded, quantization.utils.is_layer_skipped): the routed-experts
    entry the export writes keeps that FusedMoE in BF16; a pattern fully matching a prefix or one of its parts
    ('model.*', 'mlp') excludes experts too; a substring excludes Linears; routers, embeddings and lm_head are never
    quantized; a per-expert entry is ignored there (refused here); a packed Linear's shards must agree."""
    cfg, hf = without_kv(CFG), tiny_config(num_hidden_layers=LAYERS).to_dict()
    bf16 = CFG.replace(exclude_modules=("model.layers.0.mlp.experts",))
    named = list(checkpoint_tensors(tiny_model(tiny_config(num_hidden_layers=LAYERS))))
    _, exclude = build_modelopt_state(fp4_stream(named, bf16.weight_quantizer(), bf16_layers={0}), 1.0,
                                      trace_config=bf16)
    assert "model.layers.0.mlp.experts" in exclude
    audit = sglang_module_audit(cfg, hf, exclude)
    assert audit.quantized == quantized_module_names(without_kv(bf16), moe_layers=range(LAYERS), attention_layers=())
    assert "model.layers.0.mlp.experts" in audit.bf16
    assert sglang_module_audit(cfg, hf, ["model.*"]).quantized == ()  # every FusedMoE and Linear excluded
    assert sglang_module_audit(cfg, hf, ["mlp", "self_attn"]).quantized == ()
    parts = [*(f"layers.{i}.self_attn" for i in range(LAYERS)), "*experts"]
    assert sglang_module_audit(cfg, hf, parts).quantized == ()  # substrings exclude Linears, a wildcard the experts
    routers = sglang_module_audit(cfg, hf, ["self_attn"]).quantized  # no router / lm_head / embeddings entry
    assert routers == tuple(f"model.layers.{i}.mlp.experts" for i in range(LAYERS))
    for ignored in ("model.layers.0.mlp.experts.3.gate_proj", "layers.0.mlp.experts"):
        with pytest.raises(ModulePatternError, match=f"'{ignored}' matches none"):
            sglang_module_audit(cfg, hf, ["self_attn", ignored])
    with pytest.raises(ModulePatternError, match="some shards of model.layers.1.self_attn.qkv_proj"):
        sglang_module_audit(cfg, hf, ["model.layers.1.self_attn.q_proj", "o_proj"])


def test_sglang_audit_of_shared_experts():
    """Qwen2-MoE in SGLang 0.5.10: the shared expert is a quantizable MLP (excluded by its own entries), its gate a
    plain torch Linear (never quantized); no packed mapping, so q/k/v entries do not reach the fused qkv_proj."""
    c = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]).to_dict()
    cfg = without_kv(CFG)
    shared = [f"model.layers.1.mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")]
    audit = sglang_module_audit(cfg, c, ["self_attn", "model.layers.0.mlp"])
    assert audit.quantized == tuple(sorted(["model.layers.1.mlp.experts", *shared]))
    assert {"model.layers.1.mlp.shared_expert_gate", "model.layers.1.mlp.gate"} <= set(audit.bf16)
    assert sglang_module_audit(cfg, c, ["self_attn", "model.layers.0.mlp", *shared]).quantized == \
        ("model.layers.1.mlp.experts",)
    assert sglang_module_audit(cfg, c, ["self_attn", "mlp.shared_expert", "model.layers.0.mlp.gate_proj",
                                        "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]).quantized == \
        ("model.layers.1.mlp.experts",)  # an unpacked gate_up_proj is excluded by both halves named exactly
    qkv = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv"]
    assert set(qkv) <= set(sglang_module_audit(cfg, c, [*qkv, "o_proj", "mlp"]).quantized)  # shards: ignored there
    assert sglang_module_audit(cfg, c, ["qkv_proj", "o_proj", "mlp"]).quantized == ()


def test_exported_exclude_list_keeps_qwen2_moe_attention_bf16_in_sglang():
    """The export names the fused qkv_proj / gate_up_proj too: SGLang's Qwen2-MoE tests entries against them."""
    c = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])
    exported = exclude_modules_of(n for n, t in checkpoint_tensors(Qwen2MoeForCausalLM(c))
                                  if ".experts." not in n and t.dim() == 2)
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj",
            "model.layers.1.mlp.shared_expert.gate_up_proj", "model.layers.1.self_attn.q_proj"} <= set(exported)
    assert sglang_module_audit(without_kv(CFG), c.to_dict(), exported).quantized == ("model.layers.1.mlp.experts",)


def test_patterns_are_full_matches_never_substrings():
    names = ["model.layers.1.mlp.gate", "model.layers.1.mlp.gate_proj", "model.layers.11.mlp.gate"]
    assert match_modules(names, ["model.layers.1.mlp.gate"]) == {"model.layers.1.mlp.gate"}
    assert match_modules(names, ["model.layers.*.mlp.gate"]) == {names[0], names[2]}
    with pytest.raises(ModulePatternError, match="'mlp.gate' matches none of the 3 modules"):
        match_modules(names, ["mlp.gate"])


@pytest.mark.usefixtures("world1")
def test_an_fp32_trainer_and_a_bf16_rollout_disagree_on_dtype():
    """The trainer's recipe names the dtype its experts quantize from (here its fp32 parameters): against a bf16
    rollout (which quantizes the exported bf16 weights) the check fires; an fp32 rollout agrees."""
    layers = _trainer(params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False)
    assert trainer_recipe(layers).dtype == "float32"
    with pytest.raises(RecipeMismatchError, match="dtype: trainer='float32' hf rollout='bfloat16'"):
        check_recipe(trainer_recipe(layers), _hf(dtype=torch.bfloat16).recipe(), what="hf rollout")
    check_recipe(trainer_recipe(layers), _hf().recipe())


@pytest.mark.parametrize("step, dense", [(2, []), (2, [1]), (3, [])])
def test_config_derived_modules_are_the_ones_transformers_builds(step, dense):
    """``qwen3_moe_modules`` (an engine's audit, from config.json alone) against the model transformers builds from
    the same config: its MoE layers (``decoder_sparse_step``, ``mlp_only_layers``) and its 2-D-weight modules."""
    c = tiny_config(num_hidden_layers=LAYERS, decoder_sparse_step=step, mlp_only_layers=dense)
    model = Qwen3MoeForCausalLM(c)
    built = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    moe, linear = qwen3_moe_modules(c.to_dict())
    assert moe == built and 0 < len(moe) < LAYERS
    assert set(linear) == {n.removesuffix(".weight") for n, p in model.named_parameters()
                           if p.dim() == 2 and n.endswith(".weight")}


def test_kv_caches_are_not_audited_when_no_kv_site_is_quantized():
    """Without a KV site no KV cache is quantized, so none is listed, not even one ``exclude_modules`` names: the BF16
    list is exactly the modules with parameters that are not quantized (written out from the model)."""
    cfg = TraceConfig(sites=("expert_fc1_in", "expert_fc2_in", "weights"), guided_sites=("expert_fc1_in",),
                      exclude_modules=("model.layers.0.self_attn.kv_cache",))
    model = tiny_model(tiny_config(num_hidden_layers=LAYERS))
    audit = hf_module_audit(model, cfg, moe_layers=range(LAYERS), num_layers=LAYERS)
    assert audit.quantized == tuple(f"model.layers.{i}.mlp.experts" for i in range(LAYERS))
    with_params = {n for n, m in model.named_modules() if n and next(m.parameters(recurse=False), None) is not None}
    assert set(audit.bf16) == with_params - set(audit.quantized)
