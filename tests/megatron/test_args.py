"""Launch flags: --trace-* round-trip into TraceConfig; invalid combinations fail with clear messages."""

import argparse
import json

import pytest

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import add_trace_args, trace_args_from_config, trace_config_from_args


def parse(argv, **model):
    parser = add_trace_args(argparse.ArgumentParser())
    ns = parser.parse_args(argv)
    for k, v in model.items():
        setattr(ns, k, v)
    return ns


CONFIGS = [
    TraceConfig(),
    TraceConfig(enabled=False),
    TraceConfig(format="mxfp4", mxfp4_scale_rule="ceil", activation_amax="per_tensor", cache_mode="full",
                guided_layers="last_k", guided_last_k=3, rounding="stochastic", ste_clip=True, fallback="fail",
                min_coverage=0.9, routing_replay=False, kernel="reference", cache_budget_mb=12.5, cache_dir="/tmp/c"),
    TraceConfig(sites=("expert_fc1_in", "weights"), guided_sites=("expert_fc1_in",), guided_layers="explicit",
                guided_layer_list=(1, 3)),
    TraceConfig(guided_layers="budget", budget_bytes_per_token=7500.0, enabled=False),
    TraceConfig(kv_format="sglang_kvfp4"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_flags_round_trip(cfg):
    assert trace_config_from_args(parse(trace_args_from_config(cfg), num_layers=4)) == cfg


def test_trace_is_off_without_the_flag_and_defaults_follow_the_config():
    assert trace_config_from_args(parse([])) == TraceConfig(enabled=False)
    assert trace_config_from_args(parse(["--trace-fp4"])) == TraceConfig()


def test_guided_layers_accepts_a_list():
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-guided-layers", "2, 3"], num_layers=4))
    assert cfg.guided_layers == "explicit" and cfg.guided_layer_list == (2, 3)


def test_sites_narrow_the_guided_sites_by_default():
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-sites", "expert_fc1_in,weights"]))
    assert cfg.sites == ("expert_fc1_in", "weights") and cfg.guided_sites == ("expert_fc1_in",)


def test_config_file_is_the_base_and_flags_override(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TraceConfig(cache_mode="full", guided_fraction=0.25).to_dict()))
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-config", str(path), "--trace-cache-mode", "compact"]))
    assert cfg.cache_mode == "compact" and cfg.guided_fraction == 0.25


@pytest.mark.parametrize("argv,match", [
    (["--trace-fp4", "--trace-guided-layers", "1,7"], r"layer\(s\) \[7\] beyond num_layers=4"),
    (["--trace-fp4", "--trace-guided-layers", "last_k", "--trace-guided-last-k", "9"], "exceeds num_layers=4"),
    (["--trace-fp4", "--trace-cache-budget-mb", "-1"], "cache_budget_mb=-1.0 must be >= 0"),
    (["--trace-fp4", "--trace-budget-bytes-per-token", "-5"], "budget_bytes_per_token=-5.0 must be >= 0"),
    (["--trace-fp4", "--trace-budget-bytes-per-token", "nan"], "budget_bytes_per_token=nan must be a finite number"),
    (["--trace-fp4", "--trace-cache-budget-mb", "nan"], "cache_budget_mb=nan must be a finite number"),
    (["--trace-fp4", "--trace-cache-budget-mb", "inf"], "cache_budget_mb=inf must be a finite number"),
    (["--trace-fp4", "--trace-guided-layers", "last_k"], "needs guided_last_k >= 1"),
    (["--trace-fp4", "--trace-sites", "weights", "--trace-guided-sites", "kv_k"], "not a quantized site"),
    (["--trace-fp4", "--trace-min-coverage", "2"], "min_coverage=2.0 must be in"),
    (["--trace-fp4", "--trace-guided-layers", "budget", "--trace-budget-bytes-per-token", "8"],
     r"budget picks layers from measured per-layer code-mismatch rates.*cli\.plan --hf-config"),
    # without a byte budget too: the launch points to the planner, not to a flag it would refuse next
    (["--trace-fp4", "--trace-guided-layers", "budget"],
     r"budget picks layers from measured per-layer code-mismatch rates.*cli\.plan --hf-config"),
])
def test_invalid_combinations_name_the_value(argv, match):
    with pytest.raises(ValueError, match=match) as e:
        trace_config_from_args(parse(argv, num_layers=4))
    assert "--trace" in str(e.value)


@pytest.mark.parametrize("argv", [
    ["--trace-sites", "expert_fc1_in,attn_out"],
    ["--trace-guided-sites", "weights"],  # weights are never guided (no rollout record)
    ["--trace-guided-layers", "deepest"],
    ["--trace-guided-layers", "-1"],
    ["--trace-format", "int4"],
])
def test_unknown_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    err = capsys.readouterr().err
    assert "--trace-" in err


def test_unknown_site_message_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        parse(["--trace-sites", "attn_out"])
    assert "unknown site(s) ['attn_out']; valid: expert_fc1_in" in capsys.readouterr().err


def test_routing_replay_needs_megatrons_flag():
    ns = parse(["--trace-fp4"], num_experts=8, moe_enable_routing_replay=False)
    with pytest.raises(ValueError, match="--moe-enable-routing-replay"):
        trace_config_from_args(ns)
    ns = parse(["--trace-fp4", "--no-trace-routing-replay"], num_experts=8, moe_enable_routing_replay=False)
    assert trace_config_from_args(ns).routing_replay is False


def test_spec_selection_follows_the_flag():
    """What the Megatron-LM patch does in gpt_builder (patches/megatron-lm-core_v0.16.1-trace.patch)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_trace.megatron import TraceSequentialMLP, trace_spec_from_args

    stock = get_gpt_layer_local_spec(num_experts=8, normalization="RMSNorm")
    assert trace_spec_from_args(parse([], num_layers=4), stock) is stock
    spec = trace_spec_from_args(parse(["--trace-fp4", "--trace-guided-layers", "3"], num_layers=4), stock)
    experts = spec.submodules.mlp.submodules.experts
    assert experts.module is TraceSequentialMLP
    assert experts.params["trace_config"].guided_layer_list == (3,)
    assert stock.submodules.mlp.submodules.experts.module is not TraceSequentialMLP  # the stock spec is untouched
