import json
import re

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.manifest import MANIFEST_VERSION, QuantRecipe, RecipeMismatchError, check_module_sets

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
        QuantRecipe.from_json(r.to_json().replace(f'"manifest_version": {MANIFEST_VERSION}', '"manifest_version": 1'))
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


def test_mxfp4_recipes_name_no_global_amax_and_ignore_the_amax_setting():
    """MXFP4 has no global amax (``activation_quantizer`` ignores ``activation_amax``): its recipe says "none" for
    both amaxes, so two MXFP4 sides that differ only in that unused setting agree, and NVFP4 sides do not."""
    a, b = _recipe(format="mxfp4"), _recipe(format="mxfp4", activation_amax="per_tensor")
    assert a.activation_amax == a.weight_amax == "none" == b.activation_amax
    assert a.scale_rule == "e8m0_floor" and _recipe(format="mxfp4", mxfp4_scale_rule="ceil").scale_rule == "e8m0_ceil"
    a.check_matches(b)
    n = _recipe()
    assert n.activation_amax == "per_row" and n.weight_amax == "per_tensor" and n.scale_rule.startswith("e4m3_rn_sat")


def test_every_field_that_differs_is_named():
    """``check_matches`` compares every field, the last one (``manifest_version``) included, and lists them all."""
    import dataclasses

    r = _recipe()
    changed = {}
    for f in dataclasses.fields(QuantRecipe):
        v = getattr(r, f.name)
        changed[f.name] = (v + ("x",) if isinstance(v, tuple) else v + 1 if isinstance(v, int | float)
                           else v + "x")
        with pytest.raises(RecipeMismatchError, match=re.escape(f"{f.name}: trainer={v!r} rollout=")) as e:
            r.check_matches(dataclasses.replace(r, **{f.name: changed[f.name]}))
        assert ";" not in str(e.value)  # that field only
    with pytest.raises(RecipeMismatchError) as e:
        r.check_matches(dataclasses.replace(r, **changed))
    assert str(e.value).count(": trainer=") == len(changed)


def test_a_recipe_with_only_an_unknown_field_or_another_dtype_is_refused():
    d = json.loads(_recipe().to_json())
    with pytest.raises(RecipeMismatchError, match=r"unknown field\(s\) \['kv_layout'\] and lacks required "
                                                  r"field\(s\) \[\]"):
        QuantRecipe.from_json(json.dumps({**d, "kv_layout": "paged"}))
    for dtype in (torch.float64, torch.float8_e4m3fn, torch.int8):
        with pytest.raises(ValueError, match=rf"dtype={dtype} is not one of"):
            QuantRecipe.from_config(TraceConfig(), guided_layers=(), quantized_modules=MODS, dtype=dtype)


def test_module_sets_of_the_same_size_that_differ_are_refused():
    with pytest.raises(RecipeMismatchError, match=r"only in trainer \['model.layers.0.mlp.experts'\] \(1\), only in "
                                                  r"rollout \['model.layers.2.mlp.experts'\] \(1\)"):
        check_module_sets(MODS, ("model.layers.1.mlp.experts", "model.layers.2.mlp.experts"))


def test_excluded_modules_are_matched_among_the_sites_modules_even_when_trace_is_off():
    """A BF16 run (``enabled=False``) keeps its exclude list valid: the patterns are matched against the modules its
    sites would quantize, so the same config turned on later excludes the same modules."""
    from megatron_trace.manifest import ModulePatternError, excluded_modules

    kw = dict(exclude_modules=("model.layers.0.mlp.experts", "model.layers.1.self_attn.kv_cache"))
    for enabled in (True, False):
        got = excluded_modules(TraceConfig(enabled=enabled, **kw), moe_layers=(0, 1), attention_layers=(0, 1))
        assert got == ("model.layers.0.mlp.experts", "model.layers.1.self_attn.kv_cache")
    no_kv = TraceConfig(sites=("expert_fc1_in",), guided_sites=("expert_fc1_in",), **kw)
    with pytest.raises(ModulePatternError, match="'model.layers.1.self_attn.kv_cache' matches none of the 2 modules"):
        excluded_modules(no_kv, moe_layers=(0, 1), attention_layers=(0, 1))
    assert excluded_modules(TraceConfig(), moe_layers=(0,), attention_layers=(0,)) == ()


def test_guided_modules_and_the_layers_that_would_guide_nothing():
    """A layer guides its routed experts only where it is an MoE layer and its KV cache under a KV site; a policy's
    layers are refused only when none of them guides anything, an explicit list's for each such layer."""
    from megatron_trace.manifest import check_guided_layers, guided_modules, unguided_layers

    experts = dict(sites=("expert_fc1_in", "expert_fc2_in", "weights"), guided_sites=("expert_fc1_in",))
    cfg, moe = TraceConfig(**experts), {1, 3}
    assert guided_modules(cfg, 0, moe_layers=moe) == () and guided_modules(cfg, 1, moe_layers=moe) == (
        "model.layers.1.mlp.experts",)
    assert guided_modules(TraceConfig(), 0, moe_layers=set()) == ("model.layers.0.self_attn.kv_cache",)
    assert guided_modules(TraceConfig(enabled=False), 1, moe_layers=moe) == ()  # nothing quantized, nothing guided
    assert unguided_layers(cfg, [0, 1, 2], moe_layers=moe) == []  # (a policy: some layer guides)
    assert unguided_layers(cfg, [0, 2], moe_layers=moe) == [0, 2]
    assert unguided_layers(cfg, [0, 1, 2], moe_layers=moe, explicit=True) == [0, 2]
    check_guided_layers(cfg, [0, 1, 2], moe_layers=moe)
    with pytest.raises(ValueError, match=r"guided_layers='fraction' picks layer\(s\) \[0, 2\], which would guide "
                                         r"nothing.*they have none; MoE layers: \[1, 3\]"):
        check_guided_layers(cfg, [0, 2], moe_layers=moe)
    with pytest.raises(ValueError, match=r"guided_layer_list has layer\(s\) \[0\]"):
        check_guided_layers(cfg.replace(guided_layers="explicit", guided_layer_list=(0, 1)), [0, 1], moe_layers=moe)
    # nothing to guide at all (no guided site, or TRACE off): no layer is refused
    check_guided_layers(TraceConfig(**{**experts, "guided_sites": ()}), [0, 2], moe_layers=moe)
    check_guided_layers(TraceConfig(enabled=False, **experts), [0, 2], moe_layers=moe)


def test_a_dot_in_a_pattern_is_a_literal_dot():
    """ModelOpt's wildcards: ``*`` is the only one; ``.`` matches a dot only (not any character, as in a regex)."""
    from megatron_trace.manifest import ModulePatternError, match_modules, module_excluded

    cfg = TraceConfig(exclude_modules=("model.layers.1.mlp.experts",))
    assert module_excluded(cfg, "model.layers.1.mlp.experts") and not module_excluded(cfg, "model_layers.1.mlp.experts")
    assert match_modules(["model.layers.1.mlp.experts", "model.layers.11mlp.experts"], ["model.layers.1*.experts"]) \
        == {"model.layers.1.mlp.experts", "model.layers.11mlp.experts"}
    with pytest.raises(ModulePatternError, match=r"exclude pattern 'model.layers.1.mlp' matches none of the 1 modules"):
        match_modules(["model_layers_1_mlp"], ["model.layers.1.mlp"])
