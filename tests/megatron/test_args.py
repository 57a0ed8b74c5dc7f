"""Launch flags: --trace-* round-trip into TraceConfig; invalid combinations fail with clear messages."""

import argparse
import importlib.util
import json
import logging

import pytest

from megatron_trace.config import TraceConfig
from megatron_trace.manifest import ModulePatternError
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
    TraceConfig(format="mxfp4", mxfp4_scale_rule="ceil", cache_mode="full",
                guided_layers="last_k", guided_last_k=3, rounding="stochastic", ste_clip=True, fallback="fail",
                min_coverage=0.9, routing_replay=False, kernel="reference", cache_budget_mb=12.5, cache_dir="/tmp/c"),
    TraceConfig(sites=("expert_fc1_in", "weights"), guided_sites=("expert_fc1_in",), guided_layers="explicit",
                guided_layer_list=(1, 3)),
    TraceConfig(guided_layers="budget", budget_bytes_per_token=7500.0, enabled=False),
    TraceConfig(kv_format="sglang_kvfp4"),
    TraceConfig(activation_amax="per_tensor", guided_layers="all"),
    TraceConfig(exclude_modules=("model.layers.0.mlp.experts", "model.layers.*.self_attn.kv_cache")),
    TraceConfig(finite_check="sync", guided_fraction=0.25),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_flags_round_trip(cfg):
    assert trace_config_from_args(parse(trace_args_from_config(cfg), num_layers=4)) == cfg


def test_fields_the_config_does_not_use_come_back_at_their_defaults():
    """Their flags would be refused with --trace-fp4 (they would do nothing): trace_args_from_config leaves them out."""
    cfg = TraceConfig(format="mxfp4", activation_amax="per_tensor", guided_layers="all", guided_last_k=3,
                      sites=("expert_fc1_in", "weights"), guided_sites=(), kv_format="sglang_kvfp4")
    argv = trace_args_from_config(cfg)
    assert not {"--trace-activation-amax", "--trace-guided-last-k", "--trace-kv-format"} & set(argv)
    back = trace_config_from_args(parse(argv, num_layers=4))
    assert back == cfg.replace(activation_amax="per_row", guided_last_k=0, kv_format="")


def test_trace_is_off_without_the_flag_and_defaults_follow_the_config():
    assert trace_config_from_args(parse([])) == TraceConfig(enabled=False)
    assert trace_config_from_args(parse(["--trace-fp4"])) == TraceConfig()


def test_guided_layers_accepts_a_list():
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-guided-layers", "2, 3"], num_layers=4))
    assert cfg.guided_layers == "explicit" and cfg.guided_layer_list == (2, 3)


def test_sites_narrow_the_guided_sites_by_default():
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-sites", "expert_fc1_in,weights"]))
    assert cfg.sites == ("expert_fc1_in", "weights") and cfg.guided_sites == ("expert_fc1_in",)


def test_flags_without_trace_fp4_are_logged_as_ignored(caplog):
    """TRACE stays off (a launch script without --trace-fp4 trains as stock Megatron), and says what it ignores."""
    with caplog.at_level(logging.WARNING, logger="megatron_trace"):
        cfg = trace_config_from_args(parse(["--trace-reuse-weight-quant", "--trace-format", "mxfp4"]))
        assert not cfg.enabled
        assert caplog.messages == ["TRACE is off (no --trace-fp4): ignoring --trace-format --trace-reuse-weight-quant"]
        caplog.clear()
        trace_config_from_args(parse([]))
        trace_config_from_args(parse(["--trace-fp4", "--trace-format", "mxfp4"]))
    assert caplog.messages == []


@pytest.mark.parametrize("argv,match", [
    (["--trace-guided-last-k", "2"], r"--trace-guided-last-k 2 would do nothing: it is used with --trace-guided-layers "
                                     r"last_k only, and the config has guided_layers='fraction'"),
    (["--trace-guided-layers", "1,2", "--trace-guided-fraction", "0.25"],
     r"--trace-guided-fraction 0.25 would do nothing: .*guided_layers='explicit'"),
    (["--trace-guided-layers", "all", "--trace-budget-bytes-per-token", "100"],
     r"--trace-budget-bytes-per-token 100.0 would do nothing"),
    (["--trace-mxfp4-scale-rule", "ceil"], r"--trace-mxfp4-scale-rule ceil would do nothing: .*format='nvfp4'"),
    (["--trace-format", "mxfp4", "--trace-activation-amax", "per_tensor"],
     r"--trace-activation-amax per_tensor would do nothing: .*format='mxfp4'"),
    (["--trace-kv-format", "sglang_kvfp4", "--trace-sites", "expert_fc1_in,weights"],
     r"--trace-kv-format sglang_kvfp4 would do nothing: .*sites=expert_fc1_in,weights"),
    (["--trace-sites", "weights", "--trace-activation-amax", "per_tensor"],
     r"--trace-activation-amax per_tensor would do nothing: .*and the config has sites=weights$"),
    (["--trace-sites", "kv_k,kv_v", "--trace-kv-format", "sglang_kvfp4", "--trace-activation-amax", "per_tensor"],
     r"would do nothing: .*kv_k / kv_v without --trace-kv-format.*sites=kv_k,kv_v with kv_format='sglang_kvfp4'"),
    # no guided row: nothing can fall back, and the coverage is 1 by definition (0.9 was accepted and never raised)
    (["--trace-guided-layers", "none", "--trace-fallback", "fail"],
     r"--trace-fallback fail would do nothing: it is used with guided layers .* guided_layers='none'"),
    (["--trace-guided-layers", "none", "--trace-min-coverage", "0.9"],
     r"--trace-min-coverage 0.9 would do nothing: .*guided_layers='none'"),
    (["--trace-sites", "weights", "--trace-min-coverage", "0.9"],
     r"--trace-min-coverage 0.9 would do nothing: .*guided_layers='fraction' and guided_sites=''$"),
    (["--trace-guided-layers", "none", "--trace-guided-sites", "kv_k"],
     r"--trace-guided-sites 'kv_k' would do nothing: it is used with guided layers .* guided_layers='none'$"),
], ids=["last_k_under_fraction", "fraction_under_a_list", "budget_bytes_under_all", "mxfp4_scale_rule_with_nvfp4",
        "amax_with_mxfp4", "kv_format_without_kv_sites", "amax_without_activation_sites", "amax_with_sglang_kv_only",
        "fallback_without_guided_layers", "min_coverage_without_guided_layers", "min_coverage_without_guided_sites",
        "guided_sites_without_guided_layers"])
def test_a_flag_that_would_do_nothing_is_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        trace_config_from_args(parse(["--trace-fp4", *argv], num_layers=4))


def test_fallback_settings_of_a_config_that_guides_nothing_come_back_at_their_defaults():
    """trace_args_from_config leaves out --trace-fallback / --trace-min-coverage / --trace-guided-sites where no row
    is guided (they would be refused), and the coverage such a config's step reports is 1: they could not act."""
    from megatron_trace.guidance.site import FallbackCounter

    cfg = TraceConfig(guided_layers="none", fallback="fail", min_coverage=0.9, guided_sites=("kv_k",))
    argv = trace_args_from_config(cfg)
    assert not {"--trace-fallback", "--trace-min-coverage", "--trace-guided-sites"} & set(argv)
    assert trace_config_from_args(parse(argv, num_layers=4)) == cfg.replace(
        fallback="rne", min_coverage=0.0, guided_sites=("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v"))
    assert FallbackCounter().coverage == 1.0
    used = trace_config_from_args(parse(["--trace-fp4", "--trace-guided-layers", "none", "--trace-fallback", "rne",
                                         "--trace-min-coverage", "0", "--trace-sites", "kv_k,kv_v,weights",
                                         "--trace-guided-sites", "kv_k,kv_v"], num_layers=4))
    assert (used.guided_layers, used.fallback, used.min_coverage) == ("none", "rne", 0.0)  # defaults: accepted


def test_unused_flags_at_their_default_value_are_accepted(tmp_path):
    """What trace_args_from_config wrote before it left them out, and a config file's policy is what counts."""
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-guided-last-k", "0", "--trace-format", "mxfp4",
                                        "--trace-activation-amax", "per_row"], num_layers=4))
    assert cfg.guided_layers == "fraction" and cfg.format == "mxfp4"
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"guided_layers": "last_k", "guided_last_k": 1}))
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-config", str(path), "--trace-guided-last-k", "2"],
                                       num_layers=4))
    assert (cfg.guided_layers, cfg.guided_last_k) == ("last_k", 2)
    for sites in ("expert_fc2_in", "kv_v", "weights,kv_k"):  # an activation site the amax acts on: accepted
        cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-sites", sites, "--trace-activation-amax",
                                            "per_tensor"], num_layers=4))
        assert cfg.activation_amax == "per_tensor" and cfg.sites == tuple(sites.split(","))


@pytest.mark.parametrize("content,match", [
    ('{"format": "mxfp4",}', r"--trace-config .*trace.json is not JSON: Expecting property name"),
    ('["nvfp4"]', r"--trace-config .*trace.json holds a JSON list; it must be an object of TraceConfig fields"),
    ('{"guided_layer": "all"}', r"invalid --trace-config .*trace.json or the --trace-\* flags: unknown TraceConfig "
                                r"field\(s\) \['guided_layer'\]"),
    (None, r"--trace-config .*trace.json: cannot read it \(No such file or directory\)"),
], ids=["not_json", "a_list", "unknown_key", "missing"])
def test_a_bad_config_file_is_named(tmp_path, content, match):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        trace_config_from_args(parse(["--trace-fp4", "--trace-config", str(path)]))


def test_sites_narrowing_a_config_files_guided_sites_name_the_flag(tmp_path):
    """A file TraceConfig.to_dict() wrote has guided_sites: --trace-sites alone would leave them unquantized."""
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TraceConfig(format="mxfp4").to_dict()))
    argv = ["--trace-fp4", "--trace-config", str(path), "--trace-sites", "expert_fc1_in,weights"]
    match = (r"--trace-sites expert_fc1_in,weights leaves out guided sites of --trace-config .*trace.json "
             r"\(guided_sites=\['expert_fc1_in', 'expert_fc2_in', 'kv_k', 'kv_v'\]\); pass --trace-guided-sites "
             r"expert_fc1_in with it")
    with pytest.raises(ValueError, match=match):
        trace_config_from_args(parse(argv))
    cfg = trace_config_from_args(parse([*argv, "--trace-guided-sites", "expert_fc1_in"]))
    assert (cfg.format, cfg.sites, cfg.guided_sites) == ("mxfp4", ("expert_fc1_in", "weights"), ("expert_fc1_in",))
    # sites that still hold every guided site of the file (here exactly them: the weights dropped) are no narrowing
    sites = "expert_fc1_in,expert_fc2_in,kv_k,kv_v"
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-config", str(path), "--trace-sites", sites]))
    assert cfg.sites == cfg.guided_sites == tuple(sites.split(","))


def test_config_file_is_the_base_and_flags_override(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TraceConfig(cache_mode="full", guided_fraction=0.25).to_dict()))
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-config", str(path), "--trace-cache-mode", "compact"]))
    assert cfg.cache_mode == "compact" and cfg.guided_fraction == 0.25


def test_only_the_flag_turns_trace_on_whatever_the_config_file_says(tmp_path):
    """A launch script without --trace-fp4 trains as stock Megatron even from a file a TRACE run wrote
    (``to_dict`` keeps ``"enabled": true``); with the flag, a file's ``"enabled": false`` does not turn it off."""
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    on.write_text(json.dumps(TraceConfig(format="mxfp4").to_dict()))
    off.write_text(json.dumps(TraceConfig(format="mxfp4", enabled=False).to_dict()))
    assert json.loads(on.read_text())["enabled"] is True
    assert trace_config_from_args(parse(["--trace-config", str(on)])) == TraceConfig(format="mxfp4", enabled=False)
    assert trace_config_from_args(parse(["--trace-fp4", "--trace-config", str(off)])) == TraceConfig(format="mxfp4")


def test_reuse_with_the_legacy_grouped_gemm_is_not_refused_as_te_grouped_experts():
    """--moe-grouped-gemm --moe-use-legacy-grouped-gemm builds Megatron's legacy GroupedMLP, which TRACE maps to its
    torch experts (spec.experts_module): --trace-reuse-weight-quant works there, under --transformer-impl
    transformer_engine too. What remains is only Transformer Engine itself, where it does not import."""
    model = {**MEGATRON, "transformer_impl": "transformer_engine", "moe_grouped_gemm": True,
             "moe_use_legacy_grouped_gemm": True}
    args = parse(["--trace-fp4", "--trace-reuse-weight-quant"], **model)
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ImportError, match="needs Transformer Engine"):
            trace_config_from_args(args)
    else:
        assert trace_config_from_args(args).enabled


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
    ["--trace-sites", "kv_k,kv_k,weights"],  # (a typo for kv_k,kv_v: the config kept kv_k twice)
    ["--trace-guided-sites", "expert_fc1_in, expert_fc1_in"],
    ["--trace-guided-layers", "1,2,1"],
    ["--trace-guided-layers", "explicit"],  # (the policy of a layer list: given as the list itself)
    ["--trace-guided-layers", ","],  # (no layer id: not an empty list)
    ["--trace-activation-amax", "per_block"],
])
def test_unknown_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    err = capsys.readouterr().err
    assert "--trace-" in err


def test_a_repeated_list_item_is_named(capsys):
    with pytest.raises(SystemExit):
        parse(["--trace-sites", "kv_k,kv_k,weights"])
    assert "argument --trace-sites: kv_k given twice in 'kv_k,kv_k,weights'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--trace-guided-layers", "3,1,3"])
    assert "argument --trace-guided-layers: 3 given twice in '3,1,3'" in capsys.readouterr().err


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


def test_routing_replay_with_megatrons_fused_router_is_refused_by_the_flags():
    """Megatron's fused top-k (``--moe-router-fusion``, TE) never consults its RouterReplay: the flags were accepted
    at launch and only the first step given the rollout's routing refused it (``trace_guidance``)."""
    ns = parse(["--trace-fp4"], num_experts=8, moe_enable_routing_replay=True, moe_router_fusion=True)
    with pytest.raises(ValueError, match=r"--trace-routing-replay \(the default\) does not work with "
                                         r"--moe-router-fusion: .*drop --moe-router-fusion, or pass "
                                         r"--no-trace-routing-replay"):
        trace_config_from_args(ns)
    ns = parse(["--trace-fp4", "--no-trace-routing-replay"], num_experts=8, moe_router_fusion=True)
    assert trace_config_from_args(ns).routing_replay is False
    ns = parse(["--trace-fp4", "--trace-sites", "kv_k,kv_v"], num_experts=None, moe_router_fusion=True)
    assert trace_config_from_args(ns).enabled  # (a dense model: no router)


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


# What Megatron-LM's parse_args holds for the flags checked: a 2-layer, 4-expert model, torch experts
MEGATRON = dict(num_layers=2, num_experts=4, moe_layer_freq=1, moe_enable_routing_replay=True,
                moe_token_dispatcher_type="alltoall", transformer_impl="local", use_legacy_models=False, fp8=None,
                fp4=None, moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False)


@pytest.mark.parametrize("argv,model", [
    ([], {}),
    (["--trace-reuse-weight-quant"], {}),
    ([], {"num_experts": None}),  # a dense model: the KV site alone
    (["--trace-exclude-modules", "model.layers.1.mlp.experts"], {"moe_layer_freq": [0, 1]}),
    ([], {"moe_token_dispatcher_type": "allgather"}),
    ([], {"use_distributed_optimizer": True, "overlap_param_gather": False}),
    (["--trace-sites", "kv_k,kv_v"], {"use_distributed_optimizer": True, "overlap_param_gather": True}),
    ([], {"use_distributed_optimizer": True, "overlap_param_gather": True}),  # (the experts run the DDP hooks)
    # a guided layer with a guided site: a MoE layer, or any layer for the K/V sites; a policy may pick dense ones too
    (["--trace-guided-layers", "1", "--trace-guided-sites", "expert_fc1_in"], {"moe_layer_freq": [0, 1]}),
    (["--trace-guided-layers", "0"], {"moe_layer_freq": [0, 1]}),
    (["--trace-guided-layers", "all", "--trace-guided-sites", "expert_fc1_in"], {"moe_layer_freq": [0, 1]}),
    (["--trace-guided-sites", ""], {}),  # no guidance, the default policy aside
    # K/V sites only: Megatron's own experts, whose dispatcher TRACE does not guide
    (["--trace-sites", "kv_k,kv_v"], {"moe_token_dispatcher_type": "flex"}),
    ([], {"num_experts": None, "moe_enable_routing_replay": False}),  # (no router: nothing to replay)
    (["--trace-sites", "kv_k"], {"num_experts": None}),  # one KV site quantizes
    (["--trace-sites", "weights"], {}),  # weight-only QAT of the experts
    # Megatron's memory options outside the experts' forward
    ([], {"recompute_granularity": "selective", "recompute_modules": ["moe", "core_attn"],
          "fine_grained_activation_offloading": True, "offload_modules": ["core_attn", "mlp_norm"]}),
    ([], {"recompute_granularity": "full", "recompute_modules": ["moe_act"]}),  # (full: Megatron ignores the modules)
    (["--trace-sites", "kv_k,kv_v"], {"recompute_granularity": "selective", "recompute_modules": ["moe_act"],
                                      "fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1"]}),
], ids=["moe", "reuse_weight_quant", "dense_kv_only", "exclude_with_moe_layer_freq", "allgather",
        "distributed_optimizer", "overlap_param_gather_stock_experts", "overlap_param_gather", "guided_moe_layer",
        "guided_dense_layer_kv_sites", "guided_policy_some_dense", "no_guided_sites", "kv_only_stock_expert_options",
    "dense_without_routing_replay", "dense_one_kv_site", "moe_weights_only", "memory_options_outside_the_experts",
    "full_recompute_ignores_modules", "memory_options_of_stock_experts"])
def test_megatron_flags_trace_supports(argv, model):
    assert trace_config_from_args(parse(["--trace-fp4", *argv], **{**MEGATRON, **model})).enabled


@pytest.mark.parametrize("argv,model,error,match", [
    ([], {"use_legacy_models": True}, ValueError, r"--trace-fp4 needs Megatron-Core models: --use-legacy-models"),
    ([], {"modelopt_enabled": True}, ValueError, r"--trace-fp4 cannot run on a ModelOpt model: with --modelopt"),
    ([], {"moe_token_dispatcher_type": "flex"}, ValueError,
     r"TRACE experts do not support --moe-token-dispatcher-type flex \(supported: allgather, alltoall\)"),
    ([], {"fp8": "hybrid"}, ValueError, r"TRACE experts do not support --fp8-format hybrid"),
    ([], {"fp4": "e2m1"}, ValueError, r"TRACE experts do not support --fp4-format e2m1"),
    ([], {"moe_grouped_gemm": True, "recompute_granularity": "selective",
          "recompute_modules": ["core_attn", "moe_act"]}, ValueError,
     r"TRACE experts do not support --recompute-modules moe_act \(TRACE's experts do not checkpoint"),
    ([], {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn", "moe_act", "expert_fc1"]},
     ValueError, r"TRACE experts do not support --offload-modules expert_fc1 moe_act \(TRACE's experts do not offload"),
    (["--trace-sites", "expert_fc1_in,expert_fc2_in,weights"], {"num_experts": None}, ValueError,
     r"--trace-fp4 would quantize nothing: .*no KV site .*no MoE layers \(no --num-experts\)"),
    (["--trace-reuse-weight-quant", "--trace-ste-clip"], {}, ValueError, r"needs --no-trace-ste-clip"),
    (["--trace-reuse-weight-quant"], {"num_experts": None}, ValueError,
     r"--trace-reuse-weight-quant .*there are none: the model has no MoE layers"),
    (["--trace-reuse-weight-quant", "--trace-sites", "expert_fc1_in,kv_k,kv_v"], {}, ValueError,
     r"--trace-reuse-weight-quant .*--trace-sites expert_fc1_in,kv_k,kv_v does not quantize the weights"),
    (["--trace-reuse-weight-quant"], {"transformer_impl": "transformer_engine", "moe_grouped_gemm": True},
     ValueError, r"--trace-reuse-weight-quant supports TRACE's torch experts: .*--moe-grouped-gemm"),
    (["--trace-exclude-modules", "model.layers.0.mlp.experts"], {"moe_layer_freq": [0, 1]}, ModulePatternError,
     r"--trace-exclude-modules: .*'model.layers.0.mlp.experts' matches none of the 3 modules"),
    (["--trace-exclude-modules", "decoder.layers.0.mlp.experts"], {}, ModulePatternError, r"matches none"),
    # guided layers where no guided site is would guide nothing (the expert sites are in the MoE layers only)
    (["--trace-guided-layers", "0,1", "--trace-guided-sites", "expert_fc1_in,expert_fc2_in"],
     {"moe_layer_freq": [0, 1]}, ValueError,
     r"--trace-guided-layers: layer\(s\) \[0\] have no guided site: --trace-guided-sites expert_fc1_in,expert_fc2_in "
     r"\(expert sites only\) are in the MoE layers \[1\] \(--moe-layer-freq\)"),
    (["--trace-sites", "expert_fc1_in,expert_fc2_in,weights", "--trace-guided-layers", "1"],
     {"num_layers": 3, "moe_layer_freq": 2}, ValueError,
     r"layer\(s\) \[1\] have no guided site: .*MoE layers \[0, 2\]"),
    (["--trace-guided-layers", "last_k", "--trace-guided-last-k", "1", "--trace-guided-sites", "expert_fc2_in"],
     {"moe_layer_freq": [1, 0]}, ValueError, r"'last_k' picks layer\(s\) \[1\], which have no guided site"),
    (["--trace-guided-layers", "0,1", "--trace-guided-sites", ""], {}, ValueError,
     r"--trace-guided-layers 0,1 would do nothing: there is no guided site \(--trace-guided-sites is empty\)"),
    (["--trace-sites", ""], {}, ValueError,
     r"--trace-fp4 would quantize nothing: .*the routed experts are not quantized"),
    (["--trace-guided-sites", "expert_fc1_in", "--trace-guided-layers", "0"], {"num_experts": None}, ValueError,
     r"layer\(s\) \[0\] have no guided site: .*in no layer: the model has no MoE layers"),
    (["--trace-exclude-modules", "model.layers.0.mlp.experts"], {"num_experts": None}, ModulePatternError,
     r"--trace-exclude-modules: .*'model.layers.0.mlp.experts' matches none"),
], ids=["legacy_models", "modelopt", "flex_dispatcher", "fp8_recipe", "fp4_recipe", "recompute_moe_act",
        "offload_expert_inputs", "dense_expert_sites_only",
        "reuse_ste_clip", "reuse_dense", "reuse_no_weight_site", "reuse_te_grouped", "exclude_dense_layer",
        "exclude_megatron_name", "guided_list_names_a_dense_layer", "guided_list_with_int_moe_layer_freq",
        "guided_policy_picks_only_dense_layers", "guided_list_without_guided_sites", "moe_no_site",
        "dense_guided_expert_site", "exclude_dense_model"])
def test_megatron_flags_trace_refuses_before_the_build(argv, model, error, match):
    """What the patched gpt_builder meets first (before Megatron's config, spec or modules)."""
    with pytest.raises(error, match=match):
        trace_config_from_args(parse(["--trace-fp4", *argv], **{**MEGATRON, **model}))
    off = parse(argv, **{**MEGATRON, **model})  # without --trace-fp4: stock Megatron, nothing refused
    assert not trace_config_from_args(off).enabled


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine installed")
def test_transformer_engine_impl_without_te_names_the_fix():
    """Megatron's own TE specs would fail with NameError: TENorm (its default --transformer-impl)."""
    match = (r"--transformer-impl transformer_engine \(Megatron's default\) needs Transformer Engine.*"
             r"pip install 'megatron_trace\[te\]'.*--transformer-impl local")
    with pytest.raises(ImportError, match=match):
        trace_config_from_args(parse(["--trace-fp4"], **{**MEGATRON, "transformer_impl": "transformer_engine"}))


def test_bare_parsers_skip_the_megatron_checks():
    """A driver's own parser around add_trace_args has no Megatron flags: nothing is assumed about the model."""
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-sites", "weights", "--trace-reuse-weight-quant"]))
    assert cfg.sites == ("weights",)
    # but no site at all quantizes nothing whatever the model (it trained BF16 under --trace-fp4)
    with pytest.raises(ValueError, match=r"--trace-fp4 would quantize nothing: --trace-sites  has no KV site .*the "
                                         r"routed experts are not quantized"):
        trace_config_from_args(parse(["--trace-fp4", "--trace-sites", ""]))


def test_the_dispatchers_checked_are_the_experts_ones():
    from megatron_trace.megatron.args_checks import DISPATCHERS
    from megatron_trace.megatron.experts import _DISPATCHERS

    assert set(DISPATCHERS) == set(_DISPATCHERS)


@pytest.mark.parametrize("model,warned", [
    ({"moe_expert_capacity_factor": 1.25}, True),
    ({"moe_router_padding_for_quantization": True}, True),
    ({}, False),
], ids=["capacity_factor", "padding", "dropless"])
def test_a_dropping_moe_with_guided_expert_sites_is_warned_at_launch(model, warned, caplog):
    """A capacity factor with guidance was only refused at the first guided step (``trace_guidance``): the launch
    said nothing. Plain FP4 QAT runs with it, so the launch warns, naming the flag."""
    with caplog.at_level(logging.WARNING, logger="megatron_trace.megatron.args_checks"):
        trace_config_from_args(parse(["--trace-fp4", "--trace-guided-sites", "kv_k,kv_v"], **{**MEGATRON, **model}))
        assert not caplog.records, caplog.records  # KV guided sites alone need no dispatch
        assert trace_config_from_args(parse(["--trace-fp4"], **{**MEGATRON, **model})).enabled
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == warned, lines
    if warned:
        flag = "--moe-expert-capacity-factor" if "moe_expert_capacity_factor" in model else \
            "--moe-router-padding-for-quantization"
        assert lines[0].startswith(f"{flag}: TRACE guidance of the expert sites ['expert_fc1_in', 'expert_fc2_in']")
        assert "dropless" in lines[0]


def test_every_config_field_round_trips_through_a_flag():
    """Each TraceConfig field (its version aside) differs from its default in some config of CONFIGS: a field whose
    flag were lost would come back at its default there, and test_flags_round_trip would fail."""
    import dataclasses

    default = TraceConfig()
    changed = {f.name for cfg in CONFIGS for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(default, f.name)}
    assert changed == {f.name for f in dataclasses.fields(TraceConfig)} - {"version"}


def test_flags_without_trace_fp4_are_all_named_as_ignored(tmp_path, caplog):
    """Every --trace-* flag given without --trace-fp4 is named in the warning (a launch script's typo'd TRACE run)."""
    path = tmp_path / "trace.json"
    path.write_text("{}")
    parser = add_trace_args(argparse.ArgumentParser())
    values = {"--trace-config": str(path), "--trace-format": "mxfp4", "--trace-kv-format": "sglang_kvfp4",
              "--trace-mxfp4-scale-rule": "ceil", "--trace-sites": "kv_k,kv_v", "--trace-activation-amax": "per_tensor",
              "--trace-guided-sites": "kv_k", "--trace-guided-layers": "last_k", "--trace-guided-last-k": "1",
              "--trace-guided-fraction": "0.25", "--trace-budget-bytes-per-token": "10", "--trace-cache-mode": "full",
              "--trace-cache-budget-mb": "1", "--trace-cache-dir": "/tmp/c", "--trace-rounding": "stochastic",
              "--trace-ste-clip": None, "--trace-fallback": "fail", "--trace-min-coverage": "0.5",
              "--trace-routing-replay": None, "--trace-kernel": "reference", "--trace-finite-check": "sync",
              "--trace-reuse-weight-quant": None, "--trace-exclude-modules": "model.layers.0.mlp.experts"}
    flags = {"--" + a.dest.replace("_", "-") for a in parser._actions if a.dest.startswith("trace_")} - {"--trace-fp4"}
    assert set(values) == flags  # (a new flag: give it a value here)
    argv = [x for flag, v in values.items() for x in ((flag,) if v is None else (flag, v))]
    with caplog.at_level(logging.WARNING, logger="megatron_trace"):
        assert not trace_config_from_args(parser.parse_args(argv)).enabled
    named = caplog.messages[0].removeprefix("TRACE is off (no --trace-fp4): ignoring ").split()
    assert sorted(named) == sorted(flags)


def test_kv_format_with_one_kv_site_is_used():
    for site in ("kv_k", "kv_v"):
        cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-kv-format", "sglang_kvfp4", "--trace-sites",
                                            f"{site},weights"], **MEGATRON))
        assert cfg.kv_format == "sglang_kvfp4" and cfg.sites == (site, "weights") and cfg.guided_sites == (site,)


def test_exclude_module_patterns_are_stripped():
    args = parse(["--trace-exclude-modules", "model.layers.0.mlp.experts, model.layers.1.*"])
    assert args.trace_exclude_modules == ("model.layers.0.mlp.experts", "model.layers.1.*")


def test_sites_narrow_the_guided_sites_of_a_config_file_without_them(tmp_path):
    """A hand-written file without guided_sites: --trace-sites narrows their default as without a file."""
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"format": "mxfp4"}))
    cfg = trace_config_from_args(parse(["--trace-fp4", "--trace-config", str(path), "--trace-sites",
                                        "expert_fc1_in,weights"]))
    assert (cfg.format, cfg.sites, cfg.guided_sites) == ("mxfp4", ("expert_fc1_in", "weights"), ("expert_fc1_in",))


def _documented_text() -> str:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    docs = [root / "README.md", root / "patches" / "README.md", *sorted((root / "examples").rglob("*"))]
    return "\n".join(p.read_text() for p in docs if p.is_file() and p.suffix in (".md", ".sh", ".py", ".yaml"))


def test_the_flags_the_docs_name_are_the_parsers():
    """Every ``--trace-*`` flag the README, patches/README and examples name is one ``add_trace_args`` has, each
    ``--trace-X {a,b}`` list the README gives is that flag's valid values, and every flag the parser has is named in
    the docs or is a README field-table field's name with dashes, as the README says (``enabled`` is --trace-fp4,
    ``guided_layer_list`` and ``version`` have none)."""
    import dataclasses
    import re

    from megatron_trace.config import LAYER_POLICIES

    text = _documented_text()
    actions = {o: a for a in add_trace_args(argparse.ArgumentParser())._actions for o in a.option_strings}
    flags = {o for o in actions if "trace" in o}
    named = set(re.findall(r"--(?:no-)?trace-[a-z0-9-]+", text))
    assert named - flags == set(), "the docs name flags the parser does not have"
    lists = re.findall(r"(--trace-[a-z-]+) \{([^}]*)\}", text)
    assert len(lists) >= 5
    for flag, values in lists:
        listed = tuple(v.strip() for v in values.split("|")[0].split(",") if v.strip())
        valid = actions[flag].choices or tuple(p for p in LAYER_POLICIES if p not in ("explicit", "budget"))
        assert listed == tuple(valid), flag
        for v in listed:  # (each parses, and the policies that need their own flag say so by name)
            parse([flag, v])
    fields = {f.name for f in dataclasses.fields(TraceConfig)} - {"enabled", "guided_layer_list", "version"}
    by_field = {f"--trace-{f.replace('_', '-')}" for f in fields}
    assert by_field <= flags
    negated = {"--no-" + f.removeprefix("--") for f in by_field}
    assert flags - named - by_field - negated == set(), "flags the docs do not name"
