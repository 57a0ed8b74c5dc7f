import json

import pytest
import torch

from megatron_trace.config import ACTIVATION_SITES, SITES, TraceConfig, from_hydra, register_hydra
from megatron_trace.guidance import guided_layers


def test_defaults_and_round_trip():
    c = TraceConfig()
    assert c.format == "nvfp4" and c.cache_mode == "compact" and c.guided_layers == "fraction"
    d = json.loads(json.dumps(c.to_dict()))
    assert TraceConfig.from_dict(d) == c
    assert d["version"] == 1


def test_frozen_and_keyword_only():
    c = TraceConfig()
    with pytest.raises(AttributeError):
        c.format = "mxfp4"
    with pytest.raises(TypeError):
        TraceConfig("nvfp4")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"format": "int4"}, r"TraceConfig.format='int4' is not one of \('nvfp4', 'mxfp4'\)"),
        ({"sites": ("expert_fc1_in", "attn")}, r"sites\[\]='attn'"),
        ({"guided_sites": ("kv_k",), "sites": ("expert_fc1_in",)}, "not a quantized site"),
        ({"guided_layers": "middle"}, "guided_layers='middle'"),
        ({"guided_layers": "last_k"}, "needs guided_last_k >= 1"),
        ({"guided_layers": "explicit"}, "non-empty guided_layer_list"),
        ({"guided_fraction": 1.5}, r"must be in \[0, 1\]"),
        ({"guided_fraction": 0.0}, r"guided_layers='fraction' needs guided_fraction > 0 .*guided_layers='none'"),
        ({"budget_bytes_per_token": -1}, "must be >= 0"),
        ({"guided_layers": "budget"}, r"guided_layers='budget' needs budget_bytes_per_token > 0"),
        ({"min_coverage": 1.5}, r"min_coverage=1.5 must be in \[0, 1\]"),
        ({"min_coverage": -0.1}, r"min_coverage=-0.1 must be in \[0, 1\]"),
        ({"cache_budget_mb": -1}, "cache_budget_mb=-1.0 must be >= 0"),
        ({"cache_mode": "bits"}, "cache_mode='bits'"),
        ({"mxfp4_scale_rule": "round"}, "mxfp4_scale_rule='round'"),
        ({"version": 99}, "version=99 is not supported"),
        ({"fallback": "ignore"}, "fallback='ignore'"),
        ({"kv_format": "nvfp4"}, r"TraceConfig.kv_format='nvfp4' is not one of \('', 'sglang_kvfp4'\)"),
        ({"exclude_modules": ("model.layers.[0]",)}, r"exclude_modules has 'model.layers.\[0\]'"),
        ({"enabled": "false"}, r"TraceConfig.enabled='false' must be a bool, got str"),
        ({"ste_clip": 1}, r"ste_clip=1 must be a bool"),
        ({"guided_last_k": "2", "guided_layers": "last_k"}, r"guided_last_k='2' must be an int"),
        ({"guided_last_k": True}, r"guided_last_k=True must be an int"),
        ({"guided_fraction": "0.5"}, r"guided_fraction='0.5' must be a number"),
        ({"guided_layer_list": (1.5,), "guided_layers": "explicit"}, r"guided_layer_list=\[1.5\] must hold int"),
        ({"sites": "kv_k"}, r"sites='kv_k' must be a list \(not one string\)"),
        ({"exclude_modules": "model.layers.0.mlp.experts"}, r"must be a list \(not one string\)"),
        ({"cache_dir": None}, r"cache_dir=None must be a string"),
        ({"guided_layers": "budget", "budget_bytes_per_token": float("nan")},
         r"budget_bytes_per_token=nan must be a finite number, got float"),
        ({"cache_budget_mb": float("inf")}, r"cache_budget_mb=inf must be a finite number"),
        ({"min_coverage": float("nan")}, r"min_coverage=nan must be a finite number"),
        ({"sites": ("kv_k", "kv_k", "expert_fc1_in")}, r"sites=\('kv_k', 'kv_k', 'expert_fc1_in'\) holds \['kv_k'\]"),
        ({"guided_sites": ("expert_fc1_in", "expert_fc1_in")}, r"guided_sites=.* holds \['expert_fc1_in'\] more"),
    ],
)
def test_invalid_values_name_field_and_valid_choices(kw, match):
    with pytest.raises(ValueError, match=match):
        TraceConfig(**kw)


def test_kv_format_selects_the_kv_quantizer_and_round_trips():
    from megatron_trace.formats import sglang_kvfp4

    c = TraceConfig(kv_format="sglang_kvfp4", ste_clip=True)
    assert TraceConfig().kv_record_format == "nvfp4" and TraceConfig(format="mxfp4").kv_record_format == "mxfp4"
    assert TraceConfig().kv_quantizer() == TraceConfig().activation_quantizer()
    q = c.kv_quantizer()
    assert c.kv_record_format == q.fmt == "sglang_kvfp4" and q.ste_clip and q.block_size == 16
    x = torch.randn(3, 2, 32).bfloat16()
    want = sglang_kvfp4.quantize(x, compute_dtype=torch.float32)
    got = q.quantize(x)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.block_scales.view(torch.uint8),
                                                              want.block_scales.view(torch.uint8))
    assert torch.equal(q.fake_quantize(x), sglang_kvfp4.dequantize(want, x.dtype))
    with pytest.raises(ValueError, match="no global amax"):
        q.quantize(x, global_amax=torch.tensor(1.0))
    assert TraceConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c and c.to_dict()["kv_format"]


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown TraceConfig field\(s\) \['fromat'\]"):
        TraceConfig.from_dict({"fromat": "nvfp4"})


def test_quantizers_follow_config():
    c = TraceConfig(format="mxfp4", mxfp4_scale_rule="ceil")
    assert c.weight_quantizer().fmt == "mxfp4" and c.activation_quantizer().scale_rule == "ceil"
    assert not c.activation_quantizer().per_row  # MXFP4 has no global amax
    assert TraceConfig().activation_quantizer().per_row and not TraceConfig().weight_quantizer().per_row
    assert TraceConfig(activation_amax="per_tensor").activation_quantizer().per_row is False
    assert TraceConfig(enabled=False).quantizes("weights") is False
    # ste_clip reaches both quantizers, rounding the activations' only (weights are RNE on both sides)
    c = TraceConfig(ste_clip=True, rounding="stochastic")
    assert c.weight_quantizer().ste_clip and c.activation_quantizer().ste_clip
    assert c.activation_quantizer().rounding == "stochastic" and c.weight_quantizer().rounding == "rne"
    assert not TraceConfig().weight_quantizer().ste_clip and not TraceConfig().activation_quantizer().ste_clip
    assert set(SITES) - set(ACTIVATION_SITES) == {"weights"}


@pytest.mark.parametrize(
    "kw,n,expected",
    [
        ({}, 8, (4, 5, 6, 7)),
        ({"guided_fraction": 0.25}, 40, tuple(range(30, 40))),
        ({"guided_layers": "none"}, 8, ()),
        ({"guided_layers": "all"}, 3, (0, 1, 2)),
        ({"guided_layers": "last_k", "guided_last_k": 2}, 8, (6, 7)),
        ({"guided_layers": "explicit", "guided_layer_list": (5, 1, 5)}, 8, (1, 5)),
        ({"enabled": False}, 8, ()),
    ],
)
def test_guided_layer_policies(kw, n, expected):
    assert guided_layers(TraceConfig(**kw), n) == expected


def test_guided_layers_beyond_model_fail():
    with pytest.raises(ValueError, match=r"layer\(s\) \[9\] beyond num_layers=8"):
        guided_layers(TraceConfig(guided_layers="explicit", guided_layer_list=(1, 9)), 8)
    with pytest.raises(ValueError, match="guided_last_k=9 exceeds num_layers=8"):
        guided_layers(TraceConfig(guided_layers="last_k", guided_last_k=9), 8)


def test_hydra_structured_config_and_overrides():
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    register_hydra()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/main.yaml", "w").write("defaults:\n  - trace: default\n  - _self_\n")
        with initialize_config_dir(config_dir=d, version_base=None):
            cfg = compose("main", overrides=["trace.cache_mode=full", "trace.guided_layer_list=[1,2]",
                                             "trace.guided_layers=explicit", "trace.kv_format=sglang_kvfp4",
                                             "trace.exclude_modules=[model.layers.0.*,model.layers.7.mlp.experts]"])
    c = from_hydra(cfg.trace)
    assert c.cache_mode == "full" and c.guided_layer_list == (1, 2) and c.kv_format == "sglang_kvfp4"
    assert c.exclude_modules == ("model.layers.0.*", "model.layers.7.mlp.experts")
    assert TraceConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="format='fp3'"):
        from_hydra({**c.to_dict(), "format": "fp3"})
    with pytest.raises(ValueError, match="kv_format='fp4_e2m1'"):
        from_hydra({**c.to_dict(), "kv_format": "fp4_e2m1"})


def test_a_zero_fraction_is_refused_only_where_the_fraction_chooses_the_layers():
    for layers in ("none", "all"):
        assert TraceConfig(guided_layers=layers, guided_fraction=0.0).guided_fraction == 0.0


def test_defaults_are_the_readme_tables():
    """Every field's default as README's field table states it (an independent statement of the defaults: a flipped
    default, e.g. ``routing_replay`` or ``mxfp4_scale_rule``, changes what every run does without an error)."""
    import dataclasses
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    rows = text.split("| field | default | meaning |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    prose = {"true": True, "false": False, '""': "", "()": (), "all five": SITES,
             "the four activation sites": ACTIVATION_SITES}
    stated = {}
    for row in rows:
        names, defaults = (c.strip() for c in row.strip("|").split("|")[:2])
        names = [n.strip(" `") for n in names.split("/")]
        values = [v.strip() for v in defaults.split("/")] if len(names) > 1 else [defaults]
        for n, v in zip(names, values, strict=True):
            stated[n] = prose[v] if v in prose else (float(v) if v[0].isdigit() else v)
    c, fields = TraceConfig(), {f.name for f in dataclasses.fields(TraceConfig)}
    assert set(stated) == fields - {"guided_last_k", "guided_fraction", "guided_layer_list",
                                    "budget_bytes_per_token", "version"}
    for name, want in stated.items():
        assert getattr(c, name) == want, name
    assert c.guided_fraction == 0.5 and c.guided_last_k == 0 and c.guided_layer_list == () and c.version == 1


def test_a_negative_explicit_layer_is_refused():
    """A negative id would index from the end where a layer list is used (``-1``: the last layer), silently."""
    with pytest.raises(ValueError, match=r"guided_layer_list=\(2, -1\) has a negative layer"):
        TraceConfig(guided_layers="explicit", guided_layer_list=(2, -1))
    with pytest.raises(ValueError, match=r"guided_last_k=-1 must be >= 0"):
        TraceConfig(guided_last_k=-1)  # (under any policy: a config is valid whatever policy it is switched to)
