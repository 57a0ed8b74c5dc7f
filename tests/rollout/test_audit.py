"""``rollout.audit``'s SGLang 0.5.10 matching rules, function by function (the audits built from them:
``tests/operability/test_module_audit.py``)."""

import pytest

from megatron_trace.rollout.audit import SGLANG_PACKED, sglang_layer_excluded, sglang_layer_skipped

EXPERTS = "model.layers.0.mlp.experts"


def test_is_layer_excluded_tries_the_prefix_without_language_model_and_mla_tails_as_substrings():
    assert sglang_layer_excluded(f"language_model.{EXPERTS}", [EXPERTS])
    assert not sglang_layer_excluded(f"vision.{EXPERTS}", [EXPERTS])
    assert sglang_layer_excluded("model.layers.0.mlp", ["mlp"]) and sglang_layer_excluded(EXPERTS, ["model.*"])
    assert not sglang_layer_excluded(EXPERTS, ["layers.0.mlp"])  # neither the whole prefix nor one part of it
    assert not sglang_layer_excluded(EXPERTS, ["model.layers.0.mlp.expert."])  # '.' is a literal dot there
    assert sglang_layer_excluded(EXPERTS, ["model.layers.0.mlp.expert*"])
    fused = "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa"  # an MLA tail is a substring of the last part
    assert sglang_layer_excluded(fused, ["model.layers.0.self_attn.kv_a_proj_with_mqa"])
    assert not sglang_layer_excluded("model.layers.0.self_attn.qkv_proj", ["model.layers.0.self_attn.q_proj"])


def test_is_layer_skipped_needs_both_halves_of_an_unpacked_gate_up_proj():
    gate_up, packed = "model.layers.0.mlp.gate_up_proj", {}
    assert not sglang_layer_skipped(gate_up, ["model.layers.0.mlp.gate_proj"], packed)
    assert not sglang_layer_skipped(gate_up, ["model.layers.0.mlp.up_proj"], packed)
    assert sglang_layer_skipped(gate_up, ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], packed)
    assert sglang_layer_skipped(gate_up, ["layers.0.mlp"], SGLANG_PACKED)  # packed: a substring of each shard
    assert sglang_layer_skipped("model.layers.0.self_attn.o_proj", ["self_attn"], packed)
    # an experts module is skipped by an entry that holds its whole prefix (a per-expert entry)
    assert sglang_layer_skipped(EXPERTS, [f"{EXPERTS}.3.gate_proj"], packed)
    assert not sglang_layer_skipped(EXPERTS, ["model.layers.1.mlp.experts.3.gate_proj"], packed)


def test_sglang_excluded_names_the_modules_sglang_never_quantizes_and_a_bf16_run_quantizes_nothing():
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.audit import sglang_excluded, sglang_module_audit, without_kv

    hf = dict(model_type="qwen3_moe", num_hidden_layers=2, num_experts=4)
    excluded, quantizable = sglang_excluded(hf, ["self_attn"])
    never = {"model.embed_tokens", "lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}
    assert never <= excluded and not never & quantizable  # routers, embeddings, lm_head: BF16 whatever the list
    assert "model.layers.0.self_attn.q_proj" in excluded and "model.layers.0.mlp.experts" not in excluded
    cfg = without_kv(TraceConfig())
    assert sglang_module_audit(cfg, hf, None).quantized == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    off = sglang_module_audit(cfg.replace(enabled=False), hf, None)
    assert off.quantized == () and "model.layers.0.mlp.experts" in off.bf16


@pytest.mark.parametrize("hf_changes,exclude,match", [
    ({}, "self_attn", "exclude_modules='self_attn' must be a list of patterns, not one string"),
    ({}, ["self_attn", 3], r"exclude_modules holds \[3\]: each pattern must be a string"),
    ({"num_hidden_layers": 2.5}, None, "hf_config num_hidden_layers=2.5 must be an int >= 1"),
    ({"num_hidden_layers": True}, None, "hf_config num_hidden_layers=True must be an int >= 1"),
    ({"num_hidden_layers": None}, None, "hf_config num_hidden_layers=None must be an int >= 1"),
    ({"decoder_sparse_step": 0}, None, "hf_config decoder_sparse_step=0 must be an int >= 1"),
    ({"num_experts": -1}, None, "hf_config num_experts=-1 must be an int >= 0"),
    ({"mlp_only_layers": ["0"]}, None, r"hf_config mlp_only_layers=\['0'\] must be a list of int layer ids"),
])
def test_sglang_module_audit_names_a_bad_exclude_list_or_config_value(hf_changes, exclude, match):
    """One exclude string was read as its characters, each a substring of nearly every name: every Linear was
    excluded (a dense layer's MLP audited BF16); int() took 2.5 or True layers, a decoder_sparse_step 0 was read as 1
    (transformers divides by it) and a layer id "0" in mlp_only_layers matched no layer, all silently."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.audit import sglang_module_audit, without_kv

    hf = {**dict(model_type="qwen3_moe", num_hidden_layers=2, num_experts=4, mlp_only_layers=[0]), **hf_changes}
    with pytest.raises(ValueError, match=match):
        sglang_module_audit(without_kv(TraceConfig()), hf, exclude)
