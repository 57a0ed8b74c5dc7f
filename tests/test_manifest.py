import json

import pytest

from megatron_trace.config import TraceConfig
from megatron_trace.manifest import QuantRecipe, RecipeMismatchError, check_module_sets

MODS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def _recipe(**kw):
    return QuantRecipe.from_config(TraceConfig(**kw), guided_layers=(1,), quantized_modules=MODS)


def test_json_round_trip():
    r = _recipe()
    assert QuantRecipe.from_json(r.to_json()) == r
    assert r.block_size == 16 and r.scale_dtype == "float8_e4m3fn" and r.e4m3_max == 448.0


@pytest.mark.parametrize(
    "kw,field",
    [({"format": "mxfp4"}, "format"), ({"activation_amax": "per_tensor"}, "activation_amax"),
     ({"cache_mode": "full"}, "cache_mode"), ({"rounding": "stochastic"}, "trainer_rounding"),
     ({"kv_format": "sglang_kvfp4"}, "kv_format")],
)
def test_flipping_one_setting_names_the_field(kw, field):
    with pytest.raises(RecipeMismatchError, match=f"{field}: trainer="):
        _recipe().check_matches(_recipe(**kw))


def test_kv_format_is_the_kv_sites_format():
    assert _recipe().kv_format == "nvfp4" and _recipe(format="mxfp4").kv_format == "mxfp4"
    assert _recipe(kv_format="sglang_kvfp4").kv_format == "sglang_kvfp4"
    no_kv = dict(sites=("expert_fc1_in", "weights"), guided_sites=("expert_fc1_in",))
    assert _recipe(**no_kv).kv_format == "none" == _recipe(**no_kv, kv_format="sglang_kvfp4").kv_format
    assert _recipe(enabled=False).kv_format == "none"
    with pytest.raises(RecipeMismatchError, match="kv_format: trainer='sglang_kvfp4' rollout='nvfp4'"):
        _recipe(kv_format="sglang_kvfp4").check_matches(_recipe())
    r = _recipe(kv_format="sglang_kvfp4")
    assert QuantRecipe.from_json(r.to_json()) == r
    with pytest.raises(RecipeMismatchError, match="manifest_version=1"):
        QuantRecipe.from_json(r.to_json().replace('"manifest_version": 3', '"manifest_version": 1'))
    d = json.loads(r.to_json())
    with pytest.raises(RecipeMismatchError, match=r"unknown field\(s\) \['kv_layout'\] and lacks required field\(s\) "
                                                  r"\['block_size'\]; its fields are \['activation_amax'"):
        QuantRecipe.from_json(json.dumps({**{k: v for k, v in d.items() if k != "block_size"}, "kv_layout": "paged"}))
    del d["dtype"]  # a field with a default may be absent (a recipe written before it existed): the default
    assert QuantRecipe.from_json(json.dumps(d)) == r
    with pytest.raises(RecipeMismatchError, match="a JSON object of QuantRecipe's fields, not list"):
        QuantRecipe.from_json("[1, 2]")


def test_weight_version_checked_unless_ignored():
    a, b = _recipe(), _recipe().with_weight_version(3)
    with pytest.raises(RecipeMismatchError, match="weight_version: trainer=0 rollout=3"):
        a.check_matches(b)
    a.check_matches(b, ignore=("weight_version",))


def test_module_audit():
    check_module_sets(set(MODS), list(MODS))
    with pytest.raises(RecipeMismatchError, match=r"only in rollout \['model.layers.2.mlp.experts'\]"):
        check_module_sets(MODS, (*MODS, "model.layers.2.mlp.experts"))


def test_module_exclusion_is_a_full_match_never_a_prefix():
    from megatron_trace.manifest import module_excluded, quantized_module_names

    name = "model.layers.1.mlp.experts"
    assert not module_excluded(TraceConfig(exclude_modules=("model.layers.1",)), name)
    assert not module_excluded(TraceConfig(exclude_modules=("model.layers.1.mlp",)), name)
    assert module_excluded(TraceConfig(exclude_modules=("model.layers.1.*",)), name)
    cfg = TraceConfig(exclude_modules=("model.layers.1",))
    assert name in quantized_module_names(cfg, moe_layers=(0, 1), attention_layers=(0, 1))


def test_guided_sites_are_empty_where_no_layer_is_guided():
    # nothing is guided: the sites a config would guide are no numeric choice, so two such sides agree
    a = QuantRecipe.from_config(TraceConfig(guided_sites=("expert_fc1_in",)), guided_layers=(), quantized_modules=MODS)
    b = QuantRecipe.from_config(TraceConfig(), guided_layers=(), quantized_modules=MODS)
    assert a.guided_sites == () == b.guided_sites and a.guided_layers == ()
    a.check_matches(b)
    assert _recipe(guided_sites=("expert_fc1_in",)).guided_sites == ("expert_fc1_in",)
