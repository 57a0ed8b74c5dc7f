from pathlib import Path

import pytest

from megatron_trace.guidance.accounting import (
    breakdown,
    bytes_per_layer,
    bytes_per_token,
    elements_per_layer,
    row_bytes,
    side_bytes,
    site_bytes_per_token,
    totals,
)
from megatron_trace.guidance.model_dims import ModelDims
from megatron_trace.guidance.records import split_batch

from ..rollout._tiny import tiny_config
from ._data import DIMS, SITES, make_batch

DATA = Path(__file__).parent.parent / "data"
TEST_DIMS = ModelDims(
    num_layers=3, hidden=DIMS["hidden"], moe_ffn=DIMS["ffn"], topk=DIMS["topk"], kv_heads=DIMS["kv_heads"],
    head_dim=DIMS["head_dim"], moe_layers=(0, 1, 2), kv_layers=(0, 1, 2),
)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full"])
def test_bytes_per_token_equals_measured_record_bytes(fmt, compact):
    """Analytic bytes/token x tokens == nbytes of real records (payload + scales + amax)."""
    batch, _, tok, mask = make_batch(fmt=fmt, compact=compact, layers=(0, 2))
    samples = split_batch(batch, tok, version=0, attention_mask=mask)
    kw = dict(fmt=fmt, compact=compact, amax="per_row")
    per_site = breakdown(TEST_DIMS, SITES, (0, 2), **kw)
    for s in samples:
        for key, rec in s.sites.items():
            assert rec.guidance_nbytes() == per_site[key] * s.num_tokens, key
            side = side_bytes(TEST_DIMS, *key)
            assert rec.nbytes() - rec.guidance_nbytes() == side * s.num_tokens, key
        assert s.guidance_nbytes() == bytes_per_token(TEST_DIMS, SITES, (0, 2), **kw) * s.num_tokens


def test_row_bytes_formula():
    # NVFP4 K=2048: compact 256 + 128 + 4; full 1024 + 128 + 4. MXFP4 K=2048: blocks of 32.
    assert row_bytes(2048, compact=True) == 388 and row_bytes(2048, compact=False) == 1156
    assert row_bytes(2048, fmt="mxfp4", compact=True) == 256 + 64
    assert row_bytes(2048, fmt="mxfp4", compact=False) == 1024 + 64
    assert row_bytes(20, compact=True) == 32 // 8 + 2 + 4  # padded to 32
    with pytest.raises(ValueError, match="amax"):
        row_bytes(16, amax="per_block")


@pytest.mark.parametrize("k", [16, 64, 512, 2048, 7168])
def test_compact_is_one_third_of_full_per_element(k):
    """(1 + 8/16) / (4 + 8/16) = 1/3 per element; the per-row amax is the same 4 bytes in both."""
    c = row_bytes(k, compact=True, amax="per_tensor")
    f = row_bytes(k, compact=False, amax="per_tensor")
    assert 3 * c == f
    assert row_bytes(k, compact=True) - c == row_bytes(k, compact=False) - f == 4


def test_sites_absent_from_dense_and_linear_attention_layers():
    dims = ModelDims.from_hf_config(DATA / "deepseek_v3_config.json")
    assert dims.moe_layers == tuple(range(3, 61)) and dims.kv_layers == tuple(range(61))
    assert site_bytes_per_token(dims, 0, "expert_fc1_in") == 0 < site_bytes_per_token(dims, 3, "expert_fc1_in")
    assert dims.site_rows("kv_k") == (1, 576) and site_bytes_per_token(dims, 0, "kv_v") == 0  # MLA latent
    q35 = ModelDims.from_hf_config(DATA / "qwen3_5_35b_a3b_like_config.json")
    assert q35.kv_layers == tuple(range(3, 40, 4))
    per_layer = bytes_per_layer(q35, ["kv_k", "kv_v"], compact=False)
    assert [i for i, n in per_layer.items() if n] == list(range(3, 40, 4))


def test_hf_configs_parse():
    q30 = ModelDims.from_hf_config(DATA / "qwen3_30b_a3b_config.json")
    assert (q30.num_layers, q30.hidden, q30.moe_ffn, q30.topk, q30.kv_heads, q30.head_dim, q30.num_experts) == (
        48, 2048, 768, 8, 4, 128, 128)
    q235 = ModelDims.from_hf_config(DATA / "qwen3_235b_a22b_config.json")
    assert (q235.num_layers, q235.hidden, q235.moe_ffn, q235.kv_heads) == (94, 4096, 1536, 4)
    ds = ModelDims.from_hf_config(DATA / "deepseek_v3_config.json")
    assert (ds.num_layers, ds.hidden, ds.moe_ffn, ds.topk, ds.num_experts) == (61, 7168, 2048, 8, 256)


def test_a_config_saved_by_transformers_parses(tmp_path):
    # transformers 5 writes a Qwen3-MoE config.json with ``num_local_experts`` (its attribute_map), not num_experts
    import json

    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    dims = ModelDims.from_hf_config(tmp_path / "config.json")
    assert (dims.num_experts, dims.topk, dims.moe_ffn, dims.kv_heads, dims.head_dim) == (8, 2, 32, 2, 16)
    assert dims == ModelDims.from_hf_config({**saved, "num_experts": 8})


def test_hf_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="num_experts"):
        ModelDims.from_hf_config({"num_hidden_layers": 2, "hidden_size": 8, "moe_intermediate_size": 4})
    with pytest.raises(ValueError, match="layer_types"):
        ModelDims.from_hf_config({"num_hidden_layers": 2, "hidden_size": 8, "moe_intermediate_size": 4,
                                  "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 2,
                                  "num_key_value_heads": 2, "layer_types": ["full_attention"]})


def test_totals_by_site_and_layer():
    per_key = breakdown(TEST_DIMS, SITES, (0, 2), compact=True)
    t = totals(per_key, tokens=10)
    assert t["total"] == 10 * bytes_per_token(TEST_DIMS, SITES, (0, 2), compact=True)
    assert sum(t["by_layer"].values()) == t["total"] and set(t["by_layer"]) == {0, 2}
    assert t["by_site"]["expert_fc1_in"] == 10 * 2 * row_bytes(DIMS["hidden"])


@pytest.mark.parametrize("key,value,match", [
    ("hidden_size", float("nan"), r"HF config hidden_size=nan must be an integer"),
    ("hidden_size", 2048.7, r"HF config hidden_size=2048.7 must be an integer"),
    ("num_key_value_heads", float("nan"), r"HF config num_key_value_heads=nan must be an integer"),
    ("num_experts_per_tok", 200, r"ModelDims.topk=200 exceeds num_experts=128"),
    ("num_experts", 0, r"HF config num_experts=0: a model without routed experts"),
], ids=["nan", "fraction", "kv-heads-nan", "topk-above-experts", "no-experts"])
def test_hf_config_bad_values_are_named(key, value, match):
    """A NaN or 2048.7 used to be truncated or fail in int() without the key; top-k above the experts and a
    dense config passed (every layer counted as MoE)."""
    import json

    cfg = json.loads((DATA / "qwen3_30b_a3b_config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelDims.from_hf_config({**cfg, key: value})
    assert ModelDims.from_hf_config({**cfg, "hidden_size": 2048.0}).hidden == 2048  # an integral float is fine


@pytest.mark.parametrize("name,key,value,match", [
    ("qwen3_30b_a3b", "num_key_value_heads", 0, r"ModelDims.kv_heads=0 must be an int >= 1"),
    ("qwen3_30b_a3b", "head_dim", 0, r"ModelDims.head_dim=0 must be an int >= 1"),
    ("qwen3_30b_a3b", "decoder_sparse_step", 0, r"HF config decoder_sparse_step=0 must be an integer >= 1"),
    ("qwen3_30b_a3b", "decoder_sparse_step", 2.5, r"HF config decoder_sparse_step=2.5 must be an integer"),
    ("qwen3_30b_a3b", "mlp_only_layers", list(range(48)), r"no layer with routed experts of its 48"),
    ("qwen3_5_35b_a3b_like", "full_attention_interval", 0, r"full_attention_interval=0 must be an integer >= 1"),
    ("deepseek_v3", "first_k_dense_replace", 2.5, r"HF config first_k_dense_replace=2.5 must be an integer"),
    ("deepseek_v3", "first_k_dense_replace", -1, r"HF config first_k_dense_replace=-1 must be an integer >= 0"),
    ("deepseek_v3", "first_k_dense_replace", 61, r"no layer with routed experts of its 61"),
    ("deepseek_v3", "moe_layer_freq", 0, r"HF config moe_layer_freq=0 must be an integer >= 1"),
    ("deepseek_v3", "kv_lora_rank", 0, r"HF config kv_lora_rank=0 must be an integer >= 1"),
    ("qwen3_30b_a3b", "mlp_only_layers", ["1"], r"HF config mlp_only_layers=\['1'\] must be a list of int layer ids"),
], ids=["kv-heads-0", "head-dim-0", "sparse-step-0", "sparse-step-2.5", "all-dense", "interval-0", "first-dense-2.5",
        "first-dense-negative", "first-dense-all", "moe-freq-0", "mla-rank-0", "dense-layer-str"])
def test_hf_config_bad_layer_rules_and_zero_sizes_are_named(name, key, value, match):
    """Each was accepted and planned: 0 K/V heads or head_dim as one per attention head / hidden // heads, a step,
    frequency or interval of 0 (transformers divides by it) as 1, 2.5 truncated to 2 (transformers compares with
    2.5), a model whose every layer is dense with 0 expert bytes (a config without experts is refused), an MLA rank of
    0 as no MLA (every head's K/V), a dense layer id "1" as no layer."""
    import json

    cfg = json.loads((DATA / f"{name}_config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelDims.from_hf_config({**cfg, key: value})


@pytest.mark.parametrize("cls", ["Qwen3_5MoeTextConfig", "Qwen3NextConfig"])
def test_a_hybrid_config_without_layer_types_has_its_classs_kv_layers(cls):
    """A Qwen3.5-MoE / Qwen3-Next config.json with neither ``layer_types`` nor ``full_attention_interval``: transformers
    builds every 4th layer with full attention (its class default interval), the others linear attention without a
    KV cache. Every layer used to be counted with a KV cache (4x the K/V bytes)."""
    import transformers

    config = getattr(transformers, cls)(num_hidden_layers=10)
    d = {k: v for k, v in config.to_dict().items() if k not in ("layer_types", "full_attention_interval")}
    want = tuple(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    assert want == (3, 7)
    assert ModelDims.from_hf_config(d).kv_layers == want


@pytest.mark.parametrize("kw,match", [
    (dict(hidden=float("nan")), r"ModelDims.hidden=nan must be an int >= 1"),
    (dict(topk=2.5), r"ModelDims.topk=2.5 must be an int >= 1"),
    (dict(num_layers=True), r"ModelDims.num_layers=True must be an int >= 1"),
    (dict(num_experts=-1), r"ModelDims.num_experts=-1 must be an int >= 0"),
    (dict(topk=3, num_experts=2), r"ModelDims.topk=3 exceeds num_experts=2"),
    (dict(moe_layers=(-1, 0)), r"ModelDims.moe_layers has layer\(s\) \[-1\] outside 0..3"),
    (dict(kv_layers=(4,)), r"ModelDims.kv_layers has layer\(s\) \[4\] outside 0..3"),
    # were accepted: a layer 1.5 matched no layer (no site there), kv_v="no" is truthy
    (dict(moe_layers=(0, 1.5)), r"ModelDims.moe_layers has layer\(s\) \[1.5\] outside 0..3"),
    (dict(kv_layers=(True,)), r"ModelDims.kv_layers has layer\(s\) \[True\] outside 0..3"),
    (dict(kv_v="no"), r"ModelDims.kv_v='no' must be a bool"),
    # was accepted: planner.sample_bytes sized the routing of MoE layer 1 twice
    (dict(moe_layers=(0, 1, 1)), r"ModelDims.moe_layers=\(0, 1, 1\) holds layer\(s\) \[1\] more than once"),
], ids=["nan", "float", "bool", "negative-experts", "topk-above-experts", "negative-layer", "layer-beyond",
        "float-layer", "bool-layer", "kv_v-string", "layer-twice"])
def test_model_dims_reject_nan_and_non_int(kw, match):
    args = dict(num_layers=4, hidden=64, moe_ffn=32, topk=2, kv_heads=2, head_dim=16, moe_layers=(0,), kv_layers=(0,))
    with pytest.raises(ValueError, match=match):
        ModelDims(**{**args, **kw})
    assert ModelDims(**{**args, "num_experts": 2}).topk == 2  # a router may pick every expert


def _layers_of(model, has) -> tuple[int, ...]:
    return tuple(i for i, layer in enumerate(model.model.layers) if has(layer))


def test_qwen3_moe_sparse_step_and_dense_layers_match_the_transformers_model():
    """Which layers have routed experts, read from the config, is what transformers' Qwen3-MoE builds:
    ``decoder_sparse_step`` 2 puts experts on layers 1, 3, 5 (``(i + 1) % step == 0``), ``mlp_only_layers`` makes
    layer 3 dense."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = tiny_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    dims = ModelDims.from_hf_config(cfg.to_dict())
    model = Qwen3MoeForCausalLM(cfg)
    assert dims.moe_layers == _layers_of(model, lambda m: isinstance(m.mlp, Qwen3MoeSparseMoeBlock)) == (1, 5)
    assert dims.kv_layers == tuple(range(6))


def test_qwen3_5_moe_kv_layers_match_the_transformers_model():
    """Only full-attention layers have a KV cache: from ``layer_types`` or, where a config.json gives only
    ``full_attention_interval``, every interval-th layer counted from 1 (transformers' own derivation)."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    cfg = Qwen3_5MoeTextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=7, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                               full_attention_interval=3, linear_num_key_heads=2, linear_num_value_heads=2,
                               linear_key_head_dim=8, linear_value_head_dim=8)
    with_attn = tuple(i for i in range(7) if hasattr(Qwen3_5MoeDecoderLayer(cfg, i), "self_attn"))
    assert with_attn == (2, 5)
    d = cfg.to_dict()
    assert ModelDims.from_hf_config(d).kv_layers == with_attn
    interval = {k: v for k, v in d.items() if k != "layer_types"} | {"full_attention_interval": 3}
    assert ModelDims.from_hf_config(interval).kv_layers == with_attn
    assert ModelDims.from_hf_config({"text_config": d}).kv_layers == with_attn  # a multimodal wrapper's text config


@pytest.mark.parametrize("types,want", [
    (["linear_attention", "full_attention", "mamba", "attention"], (1, 3)),  # legacy names: transformers remaps them
    (["full_atention", "full_attention", "linear_attention", "full_attention"], "'full_atention'"),
], ids=["legacy-names", "typo"])
def test_layer_types_have_a_kv_cache_by_name(types, want):
    """Any entry but ``linear_attention`` used to count as a layer with a KV cache: a typo, and transformers' legacy
    ``mamba`` (its linear attention)."""
    base = {"num_hidden_layers": 4, "hidden_size": 8, "moe_intermediate_size": 4, "num_experts": 4,
            "num_experts_per_tok": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "layer_types": types}
    if isinstance(want, str):
        with pytest.raises(ValueError, match=f"layer_types has \\[{want}\\]: known are"):
            ModelDims.from_hf_config(base)
    else:
        assert ModelDims.from_hf_config(base).kv_layers == want


def test_deepseek_dense_layers_and_moe_layer_freq():
    """DeepSeek: the first ``first_k_dense_replace`` layers are dense (transformers' DeepseekV3 model); with
    ``moe_layer_freq`` the MoE layers are also every freq-th layer id (``layer_idx % moe_layer_freq == 0``: the
    DeepSeek-V2 reference code, vLLM's and SGLang's deepseek_v2)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2, kv_lora_rank=16,
                           q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    model = DeepseekV3ForCausalLM(cfg)
    dims = ModelDims.from_hf_config(cfg.to_dict())
    assert dims.moe_layers == _layers_of(model, lambda m: isinstance(m.mlp, DeepseekV3MoE)) == (2, 3, 4)
    assert dims.site_rows("kv_k") == (1, 16 + 8) and not dims.has_site(0, "kv_v")  # MLA: one latent row, no V
    every_2nd = ModelDims.from_hf_config({**cfg.to_dict(), "first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert every_2nd.moe_layers == (2, 4)
    no_dense = {k: v for k, v in cfg.to_dict().items() if k != "first_k_dense_replace"} | {"moe_layer_freq": 2}
    assert ModelDims.from_hf_config(no_dense).moe_layers == (4,)  # (DeepSeek-V3's class default: 3 dense layers)


_HYBRID = dict(vocab_size=64, hidden_size=32, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
               head_dim=16, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
               num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
               linear_value_head_dim=8, full_attention_interval=3)
_DEEPSEEK = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=5,
                 num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                 topk_group=1, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize("model_type,config,ignored", [
    ("qwen3_moe", tiny_config(num_hidden_layers=4).to_dict() | {"full_attention_interval": 2},
     ["full_attention_interval"]),
    ("qwen3_5_moe_text", _HYBRID | {"mlp_only_layers": [1], "decoder_sparse_step": 2},
     ["mlp_only_layers", "decoder_sparse_step"]),
    ("qwen3_next", _HYBRID | {"mlp_only_layers": [5], "decoder_sparse_step": 2, "intermediate_size": 32}, []),
    ("deepseek_v3", _DEEPSEEK | {"decoder_sparse_step": 2}, ["decoder_sparse_step"]),
    ("deepseek_v3", _DEEPSEEK | {"first_k_dense_replace": 1, "kv_lora_rank": 16, "qk_rope_head_dim": 8}, []),
    ("qwen3_moe", tiny_config(num_hidden_layers=4).to_dict() | {"kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                                                "first_k_dense_replace": 2},
     ["first_k_dense_replace", "kv_lora_rank"]),
    ("qwen3_5_moe_text", _HYBRID | {"kv_lora_rank": 16, "qk_rope_head_dim": 8}, ["kv_lora_rank"]),
    ("qwen3_next", _HYBRID | {"intermediate_size": 32, "first_k_dense_replace": 2, "moe_layer_freq": 2},
     ["first_k_dense_replace", "moe_layer_freq"]),
], ids=["qwen3-moe-stray-interval", "qwen3.5-stray-dense-rules", "qwen3-next", "deepseek-v3-defaults",
        "deepseek-v3-given", "qwen3-moe-stray-deepseek", "qwen3.5-stray-mla", "qwen3-next-stray-deepseek"])
def test_layers_and_kv_rows_are_what_transformers_builds_for_the_model_type(model_type, config, ignored, caplog):
    """A field the model type's transformers model does not read used to count (a stray ``full_attention_interval`` in
    a Qwen3-MoE config: 1 of 2 layers with a KV cache; ``mlp_only_layers`` / ``decoder_sparse_step`` in a Qwen3.5-MoE
    one: dense layers it builds with experts), now ignored with a warning; DeepSeek-V3's class defaults were not
    taken (no ``first_k_dense_replace``: 0 dense layers for its 3; no ``kv_lora_rank``: no MLA, every head's K/V)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in config.items() if k != "model_type"}  # (as a config.json: model_type and its fields)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    dims = ModelDims.from_hf_config({"model_type": model_type, **config})
    assert dims.moe_layers == _layers_of(model, lambda m: hasattr(m.mlp, "experts"))
    assert dims.kv_layers == _layers_of(model, lambda m: hasattr(m, "self_attn"))
    attn = model.model.layers[dims.kv_layers[0]].self_attn
    rows, k = dims.site_rows("kv_k")  # K/V per token: every K/V head's row, or MLA's one latent + RoPE key row
    assert rows * k == (attn.k_proj if dims.kv_v else attn.kv_a_proj_with_mqa).out_features
    assert all(f in caplog.text for f in ignored) and ("ignores" in caplog.text) == bool(ignored)


@pytest.mark.parametrize("call,match", [
    # were accepted: k=2.5 gave 7.0 bytes, NaN nan, True one element; compact="no" (truthy) the compact size;
    # a layer 1.5 had no site (0 bytes), True was layer 1
    (lambda d: row_bytes(2.5), r"row length k=2.5 must be an int >= 1"),
    (lambda d: row_bytes(float("nan")), r"row length k=nan must be an int >= 1"),
    (lambda d: row_bytes(True), r"row length k=True must be an int >= 1"),
    (lambda d: row_bytes("16"), r"row length k='16' must be an int >= 1"),
    (lambda d: row_bytes(32, compact="no"), r"compact='no' must be a bool"),
    (lambda d: breakdown(d, ["expert_fc1_in"], [1.5]), r"layer=1.5 must be an int layer id in 0..2"),
    (lambda d: breakdown(d, ["expert_fc1_in"], [True]), r"layer=True must be an int layer id in 0..2"),
    # were accepted: a site given twice counted twice per layer (once by breakdown), tokens=2.5 gave float bytes,
    # True one token, -3 negative bytes; a layer off the model or 1.5 had no site (0 bytes); id bytes 2.5 7.0 bytes
    (lambda d: bytes_per_layer(d, ["kv_k", "expert_fc1_in", "kv_k"]), r"holds \['kv_k'\] more than once"),
    (lambda d: elements_per_layer(d, ["kv_v", "kv_v"]), r"sites=\['kv_v', 'kv_v'\] holds \['kv_v'\] more than once"),
    (lambda d: breakdown(d, ["kv_k", "kv_k"], [0]), r"holds \['kv_k'\] more than once"),
    (lambda d: bytes_per_layer(d, "kv_k"), r"sites='kv_k' must be a list of sites from"),
    (lambda d: totals(breakdown(d, ["kv_k"], [0]), tokens=2.5), r"tokens=2.5 must be an int >= 0"),
    (lambda d: totals(breakdown(d, ["kv_k"], [0]), tokens=True), r"tokens=True must be an int >= 0"),
    (lambda d: totals(breakdown(d, ["kv_k"], [0]), tokens=-3), r"tokens=-3 must be an int >= 0"),
    (lambda d: site_bytes_per_token(d, 3, "kv_k"), r"layer=3 outside 0..2"),
    (lambda d: site_bytes_per_token(d, 1.5, "kv_k"), r"layer=1.5 must be an int layer id in 0..2"),
    (lambda d: side_bytes(d, -1, "kv_k"), r"layer=-1 outside 0..2"),
    (lambda d: side_bytes(d, 0, "expert_fc2_in", expert_id_bytes=2.5), r"expert_id_bytes=2.5 must be an int >= 1"),
], ids=["k-float", "k-nan", "k-bool", "k-str", "compact-str", "layer-float", "layer-bool", "site-twice-per-layer",
        "site-twice-elements", "site-twice-breakdown", "sites-str", "tokens-float", "tokens-bool", "tokens-negative",
        "site-layer-beyond", "site-layer-float", "side-layer-negative", "id-bytes-float"])
def test_bad_row_lengths_flags_and_layers_are_named(call, match):
    dims = ModelDims.from_hf_config(tiny_config().to_dict())
    with pytest.raises(ValueError, match=match):
        call(dims)
    assert row_bytes(32) == 4 + 2 + 4 and breakdown(dims, ["expert_fc1_in"], [1])  # (the valid twins)
    sites = ["kv_k", "expert_fc1_in"]
    assert bytes_per_layer(dims, sites)[2] == totals(breakdown(dims, sites, [2]), tokens=1)["by_layer"][2] > 0


def test_breakdown_names_a_layer_outside_the_model():
    dims = ModelDims.from_hf_config(tiny_config().to_dict())
    for layer in (-1, 3):
        with pytest.raises(ValueError, match=rf"layer={layer} outside 0..2"):
            breakdown(dims, ["expert_fc1_in"], [layer])


def test_a_qwen3_moe_config_without_head_dim_or_kv_heads():
    """A config.json without ``head_dim`` has heads of ``hidden_size // num_attention_heads`` (what transformers'
    Qwen3-MoE attention builds); a null ``num_key_value_heads`` means multi-head attention, one K/V head per head
    (the transformers convention, e.g. ``DeepseekV3Config``'s)."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = {k: v for k, v in tiny_config(num_attention_heads=2, num_hidden_layers=1).to_dict().items() if k != "head_dim"}
    attn = Qwen3MoeForCausalLM(Qwen3MoeConfig(**d)).model.layers[0].self_attn
    dims = ModelDims.from_hf_config(d)
    assert (dims.head_dim, dims.kv_heads * dims.head_dim) == (attn.head_dim, attn.k_proj.out_features) == (32, 64)
    mha = ModelDims.from_hf_config({**d, "num_key_value_heads": None})
    assert mha.kv_heads == DeepseekV3Config(num_attention_heads=2, num_key_value_heads=None).num_key_value_heads == 2


def test_a_config_without_kv_heads_takes_transformers_default_of_its_model_type():
    """A config.json that leaves ``num_key_value_heads`` out gets its class's default when transformers builds the
    model (Qwen3-MoE: 4 K/V heads; Qwen3.5-MoE's text model: 2 of head_dim 256), not one per attention head; a
    model type whose default is not known here is refused by name."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = {k: v for k, v in tiny_config(num_attention_heads=8, num_hidden_layers=1).to_dict().items()
         if k not in ("num_key_value_heads", "head_dim")}
    attn = Qwen3MoeForCausalLM(Qwen3MoeConfig(**d)).model.layers[0].self_attn
    dims = ModelDims.from_hf_config(d)
    assert (dims.kv_heads, dims.head_dim) == (attn.k_proj.out_features // attn.head_dim, attn.head_dim) == (4, 8)
    text = {k: v for k, v in d.items() if k != "model_type"}  # a Qwen3.5 wrapper's text_config, type left out
    want = Qwen3_5MoeTextConfig(**text)
    got = ModelDims.from_hf_config({"model_type": "qwen3_5_moe", "text_config": text})
    assert (got.kv_heads, got.head_dim) == (want.num_key_value_heads, want.head_dim) == (2, 256)
    with pytest.raises(ValueError, match=r"model_type='mixtral'\) has no num_key_value_heads.*known: \['qwen3_5"):
        ModelDims.from_hf_config({**d, "model_type": "mixtral"})
