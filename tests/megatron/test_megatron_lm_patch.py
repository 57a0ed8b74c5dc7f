"""patches/megatron-lm-core_v0.16.1-trace.patch applied to Megatron-LM's launcher: ``pretrain_gpt.py --trace-fp4``
parses, and the patched ``gpt_builder`` builds TRACE's experts and KV site (stock modules without the flag); the
``--trace-*`` flags combined with Megatron's own, as a user types them, either work or fail before the model is built
with an error that names the flag and what is valid, and none is silently ignored.

Megatron-LM's training code is not on the package registries: set ``MEGATRON_LM`` to a checkout of tag
``core_v0.16.1`` (patched or not: the test applies the patch to a copy; Megatron-LM's tokenizers also need ``six``).
Skipped otherwise (CI): tests/megatron/test_args.py checks the same refusals on a plain argparse parser. The GPU run of
``pretrain_gpt.py`` itself is ``examples/megatron_lm/pretrain_tiny_moe.sh`` (BENCHMARKS.md, session 42).

All cases run in one worker process (``_megatron_lm_worker.py``), each parsing its own command line. Not checkable
here (one CPU process, no Transformer Engine): tensor / pipeline / virtual-pipeline parallel sizes > 1 (Megatron's
``validate_args`` refuses them for a world of 1), ``--moe-grouped-gemm`` (``validate_args`` queries CUDA), and
Megatron's fp8/fp4 recipes with TE installed (TRACE's experts refuse them at build: ``test_experts.py``)."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches" / "megatron-lm-core_v0.16.1-trace.patch"
FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron/training", "megatron/legacy",
         "megatron/post_training", "megatron/rl")
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "16", "--max-position-embeddings", "16",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "32", "--ffn-hidden-size", "128", "--moe-token-dispatcher-type", "alltoall",
         "--moe-enable-routing-replay", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
         "--lr", "1e-4", "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
         "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "128"]
MOE = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-token-dispatcher-type",
       "--moe-enable-routing-replay")
CONFIG_FILES = {  # written to {tmp}/NAME.json
    "ok": {"format": "mxfp4", "guided_layers": "last_k", "guided_last_k": 1, "cache_mode": "full"},
    "unknown_key": {"format": "mxfp4", "guided_layer": "last_k"},
    "bad_value": {"format": "int4"},
    "bad_type": {"ste_clip": "false"},
    "a_list": ["nvfp4"],
}


def flags(*extra: str, drop: tuple[str, ...] = ()) -> list[str]:
    """The base command line (a 2-layer, 4-expert GPT, torch impl) less the flags in ``drop`` (with their values),
    plus ``extra``."""
    out, i = [], 0
    while i < len(FLAGS):
        has_value = i + 1 < len(FLAGS) and not FLAGS[i + 1].startswith("--")
        if FLAGS[i] not in drop:
            out += FLAGS[i:i + 1 + has_value]
        i += 1 + has_value
    return out + list(extra)


# ---- the cases: (id, command line, stage to stop after) -----------------------------------------------------------
WORKS = {  # id: (argv, stop, check of the worker's facts)
    "trace_fp4": (flags("--trace-fp4"), "", lambda r: (
        {"TraceSequentialMLP", "TraceDotProductAttention"} <= set(r["modules"]) and r["expert_grads"] > 0
        and r["expert_grads_nonzero"] == r["expert_grads"])),
    "stock": (flags(), "", lambda r: (
        not any(m.startswith("Trace") for m in r["modules"])
        and {"SequentialMLP", "DotProductAttention"} <= set(r["modules"]))),
    "no_replay_without_megatron_replay": (
        flags("--trace-fp4", "--no-trace-routing-replay", drop=("--moe-enable-routing-replay",)), "build",
        lambda r: r["trace_config"]["routing_replay"] is False and "TraceSequentialMLP" in r["modules"]),
    "dense_model_kv_site_only": (flags("--trace-fp4", drop=MOE), "", lambda r: (
        "TraceDotProductAttention" in r["modules"] and "MoELayer" not in r["modules"] and r["expert_grads"] == 0)),
    "reuse_weight_quant": (flags("--trace-fp4", "--trace-reuse-weight-quant"), "", lambda r: (
        r["expert_grads"] > 0 and r["expert_grads_nonzero"] == r["expert_grads"])),
    "mxfp4": (flags("--trace-fp4", "--trace-format", "mxfp4", "--trace-mxfp4-scale-rule", "ceil"), "", lambda r: (
        r["trace_config"]["format"] == "mxfp4" and r["trace_config"]["mxfp4_scale_rule"] == "ceil"
        and r["expert_grads_nonzero"] > 0)),
    "guided_none": (flags("--trace-fp4", "--trace-guided-layers", "none"), "build",
                    lambda r: r["trace_config"]["guided_layers"] == "none"),
    "guided_all": (flags("--trace-fp4", "--trace-guided-layers", "all"), "build",
                   lambda r: r["trace_config"]["guided_layers"] == "all"),
    "guided_last_k": (flags("--trace-fp4", "--trace-guided-layers", "last_k", "--trace-guided-last-k", "1"), "build",
                      lambda r: (r["trace_config"]["guided_layers"], r["trace_config"]["guided_last_k"])
                      == ("last_k", 1)),
    "guided_fraction": (flags("--trace-fp4", "--trace-guided-layers", "fraction", "--trace-guided-fraction", "0.25"),
                        "build", lambda r: r["trace_config"]["guided_fraction"] == 0.25),
    "guided_list": (flags("--trace-fp4", "--trace-guided-layers", "0,1"), "build", lambda r: (
        (r["trace_config"]["guided_layers"], r["trace_config"]["guided_layer_list"]) == ("explicit", [0, 1]))),
    "config_file_and_overrides": (
        flags("--trace-fp4", "--trace-config", "{tmp}/ok.json", "--trace-guided-layers", "all", "--trace-format",
              "nvfp4"), "build", lambda r: (
            r["trace_config"]["format"], r["trace_config"]["guided_layers"], r["trace_config"]["cache_mode"])
        == ("nvfp4", "all", "full")),
    "exclude_modules": (flags("--trace-fp4", "--trace-exclude-modules",
                              "model.layers.0.mlp.experts,model.layers.1.self_attn.kv_cache"), "",
                        lambda r: r["expert_grads_nonzero"] == r["expert_grads"] > 0),
    # --skip-train: Megatron-LM's evaluate runs with no train step before it (its trace_eval_start binds the layers)
    "exclude_modules_evaluate_first": (flags("--trace-fp4", "--trace-exclude-modules", "model.layers.0.mlp.experts",
                                             "--skip-train"), "evaluate", lambda r: r["evaluated"]),
    "kv_format_sglang": (flags("--trace-fp4", "--trace-kv-format", "sglang_kvfp4"), "",
                         lambda r: r["trace_config"]["kv_format"] == "sglang_kvfp4" and r["expert_grads"] > 0),
    "allgather_dispatcher": (flags("--trace-fp4", "--moe-token-dispatcher-type", "allgather",
                                   drop=("--moe-token-dispatcher-type",)), "", lambda r: r["expert_grads_nonzero"] > 0),
    "shared_experts_stay_bf16": (flags("--trace-fp4", "--moe-shared-expert-intermediate-size", "32"), "", lambda r: (
        {"TraceSequentialMLP", "SharedExpertMLP"} <= set(r["modules"]) and r["expert_grads_nonzero"] > 0)),
    "mtp_layers_keep_the_stock_spec": (flags("--trace-fp4", "--mtp-num-layers", "1"), "", lambda r: (
        "TraceSequentialMLP" in r["modules"] and {"SequentialMLP", "DotProductAttention"} <= set(r["mtp_modules"])
        and not any(m.startswith("Trace") for m in r["mtp_modules"]))),
    "moe_layer_freq": (flags("--trace-fp4", "--moe-layer-freq", "[0,1]", "--trace-exclude-modules",
                             "model.layers.1.mlp.experts"), "", lambda r: r["expert_grads"] > 0),
    # without --trace-fp4 TRACE is off, as documented, and the --trace-* flags given are said to be ignored
    "reuse_without_trace_fp4": (flags("--trace-reuse-weight-quant"), "build", lambda r: (
        not any(m.startswith("Trace") for m in r["modules"])
        and r["warnings"] == ["TRACE is off (no --trace-fp4): ignoring --trace-reuse-weight-quant"])),
    "config_file_without_trace_fp4": (flags("--trace-config", "{tmp}/ok.json", "--trace-format", "mxfp4"), "build",
                                      lambda r: r["warnings"] == [
                                          "TRACE is off (no --trace-fp4): ignoring --trace-format --trace-config"]),
}

CLEAR_ERRORS = {  # id: (argv, stage, error type, message pattern); raised by TRACE before the model is built
    "replay_needs_megatron_replay": (
        flags("--trace-fp4", drop=("--moe-enable-routing-replay",)), "build", "ValueError",
        r"--trace-routing-replay \(the default\) needs Megatron's --moe-enable-routing-replay.*--no-trace-routing"),
    "transformer_engine_not_installed": (
        flags("--trace-fp4", "--transformer-impl", "transformer_engine", drop=("--transformer-impl",)), "build",
        "ImportError", r"--transformer-impl transformer_engine .*needs Transformer Engine.*--transformer-impl local"),
    "reuse_with_ste_clip": (flags("--trace-fp4", "--trace-reuse-weight-quant", "--trace-ste-clip"), "build",
                            "ValueError", r"--trace-reuse-weight-quant needs --no-trace-ste-clip"),
    "reuse_dense_model": (flags("--trace-fp4", "--trace-reuse-weight-quant", drop=MOE), "build", "ValueError",
                          r"--trace-reuse-weight-quant .* none: the model has no MoE layers"),
    "reuse_weights_not_quantized": (
        flags("--trace-fp4", "--trace-reuse-weight-quant", "--trace-sites", "kv_k,kv_v"), "build", "ValueError",
        r"--trace-reuse-weight-quant .* --trace-sites kv_k,kv_v does not quantize the weights"),
    "dense_model_expert_sites_only": (
        flags("--trace-fp4", "--trace-sites", "expert_fc1_in,expert_fc2_in,weights", drop=MOE), "build",
        "ValueError", r"--trace-fp4 would quantize nothing: .*no KV site.*no MoE layers"),
    "last_k_without_the_policy": (flags("--trace-fp4", "--trace-guided-last-k", "1"), "build", "ValueError",
                                  r"--trace-guided-last-k 1 would do nothing: .*last_k.*guided_layers='fraction'"),
    "fraction_with_a_list": (flags("--trace-fp4", "--trace-guided-layers", "1", "--trace-guided-fraction", "0.25"),
                             "build", "ValueError", r"--trace-guided-fraction 0.25 would do nothing"),
    "last_k_without_k": (flags("--trace-fp4", "--trace-guided-layers", "last_k"), "build", "ValueError",
                         r"guided_layers='last_k' needs guided_last_k >= 1"),
    "last_k_beyond_the_depth": (flags("--trace-fp4", "--trace-guided-layers", "last_k", "--trace-guided-last-k", "5"),
                                "build", "ValueError", r"--trace-guided-layers for --num-layers 2: guided_last_k=5"),
    "list_beyond_the_depth": (flags("--trace-fp4", "--trace-guided-layers", "1,2"), "build", "ValueError",
                              r"layer\(s\) \[2\] beyond num_layers=2 \(valid 0..1\)"),
    "fraction_above_one": (flags("--trace-fp4", "--trace-guided-fraction", "1.5"), "build", "ValueError",
                           r"guided_fraction=1.5 must be in \[0, 1\]"),
    "budget_at_launch": (flags("--trace-fp4", "--trace-guided-layers", "budget", "--trace-budget-bytes-per-token",
                               "100"), "build", "ValueError", r"budget picks layers .*cli\.plan"),
    "config_unknown_key": (flags("--trace-fp4", "--trace-config", "{tmp}/unknown_key.json"), "build", "ValueError",
                           r"--trace-config .*unknown_key.json.*unknown TraceConfig field\(s\) \['guided_layer'\]"),
    "config_bad_value": (flags("--trace-fp4", "--trace-config", "{tmp}/bad_value.json"), "build", "ValueError",
                         r"--trace-config .*format='int4' is not one of \('nvfp4', 'mxfp4'\)"),
    "config_bad_type": (flags("--trace-fp4", "--trace-config", "{tmp}/bad_type.json"), "build", "ValueError",
                        r"ste_clip='false' must be a bool"),
    "config_not_json": (flags("--trace-fp4", "--trace-config", "{tmp}/not_json.json"), "build", "ValueError",
                        r"--trace-config .*not_json.json is not JSON"),
    "config_a_list": (flags("--trace-fp4", "--trace-config", "{tmp}/a_list.json"), "build", "ValueError",
                      r"--trace-config .*a_list.json holds a JSON list; it must be an object of TraceConfig fields"),
    "config_missing": (flags("--trace-fp4", "--trace-config", "{tmp}/missing.json"), "build", "ValueError",
                       r"--trace-config .*missing.json: cannot read it \(No such file"),
    "exclude_matches_nothing": (flags("--trace-fp4", "--trace-exclude-modules", "decoder.layers.0.mlp.experts"),
                                "build", "ModulePatternError",
                                r"--trace-exclude-modules: .*'decoder.layers.0.mlp.experts' matches none"),
    "exclude_a_dense_layer": (flags("--trace-fp4", "--moe-layer-freq", "[0,1]", "--trace-exclude-modules",
                                    "model.layers.0.mlp.experts"), "build", "ModulePatternError",
                              r"'model.layers.0.mlp.experts' matches none of the 3 modules"),
    "exclude_bad_pattern": (flags("--trace-fp4", "--trace-exclude-modules", "model/layers/0"), "build", "ValueError",
                            r"exclude_modules has 'model/layers/0': a pattern is a module name"),
    "kv_format_head_dim": (flags("--trace-fp4", "--trace-kv-format", "sglang_kvfp4", "--kv-channels", "8",
                                 drop=("--kv-channels",)), "build", "ValueError",
                           r"kv_format='sglang_kvfp4' needs kv_channels \(head_dim\) to be a multiple of 16, got 8"),
    "kv_format_without_kv_sites": (flags("--trace-fp4", "--trace-kv-format", "sglang_kvfp4", "--trace-sites",
                                         "expert_fc1_in,weights"), "build", "ValueError",
                                   r"--trace-kv-format sglang_kvfp4 would do nothing"),
    "mxfp4_per_tensor_amax": (flags("--trace-fp4", "--trace-format", "mxfp4", "--trace-activation-amax",
                                    "per_tensor"), "build", "ValueError",
                              r"--trace-activation-amax per_tensor would do nothing: .*format='mxfp4'"),
    "nvfp4_mxfp4_scale_rule": (flags("--trace-fp4", "--trace-mxfp4-scale-rule", "ceil"), "build", "ValueError",
                               r"--trace-mxfp4-scale-rule ceil would do nothing: .*format='nvfp4'"),
    "expert_tensor_parallel": (flags("--trace-fp4", "--expert-tensor-parallel-size", "2"), "build", "ValueError",
                               r"TRACE experts do not support expert_tensor_parallel_size=2 \(supported: 1\)"),
    "flex_dispatcher": (flags("--trace-fp4", "--moe-token-dispatcher-type", "flex",
                              drop=("--moe-token-dispatcher-type",)), "build", "ValueError",
                        r"TRACE experts do not support --moe-token-dispatcher-type flex \(supported: allgather, "),
    "megatron_fp8_recipe": (flags("--trace-fp4", "--fp8-format", "hybrid"), "build", "ValueError",
                            r"TRACE experts do not support --fp8-format hybrid"),
    "bias_linear": (flags("--trace-fp4", drop=("--disable-bias-linear",)), "build", "ValueError",
                    r"add_bias_linear=True \(use --disable-bias-linear\)"),
    "probs_on_input": (flags("--trace-fp4", "--moe-apply-probs-on-input"), "build", "ValueError",
                       r"moe_apply_probs_on_input=True"),
    "legacy_models": (flags("--trace-fp4", "--use-legacy-models", "--ckpt-format", "torch"), "build", "ValueError",
                      r"--trace-fp4 needs Megatron-Core models: --use-legacy-models"),
    "guided_a_dense_layer": (flags("--trace-fp4", "--moe-layer-freq", "[0,1]", "--trace-guided-layers", "0",
                                   "--trace-guided-sites", "expert_fc1_in,expert_fc2_in"), "build", "ValueError",
                             r"--trace-guided-layers: layer\(s\) \[0\] have no guided site: .*MoE layers \[1\]"),
}

ARGPARSE_ERRORS = {  # id: (argv, what argparse prints)
    "guided_layers_explicit_word": (flags("--trace-fp4", "--trace-guided-layers", "explicit"),
                                    r"--trace-guided-layers: 'explicit' is neither a policy \(none, all, last_k"),
    "guided_layers_empty": (flags("--trace-fp4", "--trace-guided-layers", ""), r"layer ids must be >= 0, got ''"),
    "kv_format_nvfp4": (flags("--trace-fp4", "--trace-kv-format", "nvfp4"),
                        r"--trace-kv-format: invalid choice: 'nvfp4' \(choose from '', 'sglang_kvfp4'\)"),
    "unknown_site": (flags("--trace-fp4", "--trace-sites", "attn_out"), r"unknown site\(s\) \['attn_out'\]; valid"),
}

MEGATRON_FIRST = {  # id: (argv, message): Megatron's validate_args refuses these before any TRACE code runs
    # no Transformer Engine: Megatron's own TypeError, TRACE or not (with TE >= 2.7, TRACE's experts refuse it)
    "fp4_recipe_without_te": (flags("--trace-fp4", "--fp4-format", "e2m1"), r"'>=' not supported"),
    "virtual_pipeline_without_pipeline": (flags("--trace-fp4", "--num-layers-per-virtual-pipeline-stage", "1"),
                                          r"pipeline-model-parallel size should be greater than 1"),
}

CASES = {**{k: (v[0], v[1]) for k, v in WORKS.items()}, **{k: (v[0], v[1]) for k, v in CLEAR_ERRORS.items()},
         **{k: (v[0], "parse") for k, v in {**ARGPARSE_ERRORS, **MEGATRON_FIRST}.items()}}


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    src = os.environ.get("MEGATRON_LM")
    if not src:
        pytest.skip("set MEGATRON_LM to a Megatron-LM checkout at core_v0.16.1 (its training code is not on PyPI)")
    src, dst = Path(src), tmp_path_factory.mktemp("megatron_lm")
    for f in FILES:
        (shutil.copytree if (src / f).is_dir() else shutil.copy)(src / f, dst / f)
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    applied = subprocess.run(["git", "apply", "--check", "--reverse", str(PATCH)], cwd=dst, capture_output=True)
    if applied.returncode != 0:  # not patched yet
        subprocess.run(["git", "apply", str(PATCH)], cwd=dst, check=True, capture_output=True)
    return dst


@pytest.fixture(scope="module")
def results(patched, tmp_path_factory) -> dict:
    """Every case's facts, from one worker process."""
    tmp = tmp_path_factory.mktemp("trace_configs")
    for name, content in CONFIG_FILES.items():
        (tmp / f"{name}.json").write_text(json.dumps(content))
    (tmp / "not_json.json").write_text('{"format": "mxfp4",}')
    cases = [{"id": k, "argv": [a.replace("{tmp}", str(tmp)) for a in argv], "stop": stop}
             for k, (argv, stop) in CASES.items()]
    (tmp / "cases.json").write_text(json.dumps(cases))
    path = [str(patched), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TORCHDYNAMO_DISABLE": "1"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_megatron_lm_worker.py")),
                          str(tmp / "cases.json")], cwd=patched, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"id"')]
    return {r["id"]: r for r in facts}


@pytest.mark.parametrize("case", WORKS)
def test_combination_works(results, case):
    r = results[case]
    assert "error" not in r, r.get("traceback", r)
    assert WORKS[case][2](r), r
    assert r["trace_fp4"] == ("--trace-fp4" in WORKS[case][0])
    if r["trace_fp4"]:
        assert r["warnings"] == []
    if "loss" in r or "evaluated" in r:
        assert r["evaluate_calls_trace_eval_start"] and r["evaluate_calls_trace_eval_done"]


@pytest.mark.parametrize("case", CLEAR_ERRORS)
def test_combination_fails_early_naming_the_flag(results, case):
    _, stage, error, pattern = CLEAR_ERRORS[case]
    r = results[case]
    assert r.get("error") == error, r.get("traceback", r)
    assert re.search(pattern, r["message"]), r["message"]
    assert r["stage"] == stage and r["raised_in"].startswith("megatron_trace/"), r  # before any train step


@pytest.mark.parametrize("case", ARGPARSE_ERRORS)
def test_bad_value_is_an_argparse_error(results, case):
    r = results[case]
    assert r["error"] == "SystemExit" and r["message"] == "2", r
    assert re.search(ARGPARSE_ERRORS[case][1], r["stderr"]), r["stderr"]


@pytest.mark.parametrize("case", MEGATRON_FIRST)
def test_megatron_refuses_first(results, case):
    """Documents what the user meets: Megatron's own check, before TRACE's code runs (the same without TRACE)."""
    if case == "fp4_recipe_without_te" and importlib.util.find_spec("transformer_engine"):
        pytest.skip("Transformer Engine is installed")
    r = results[case]
    assert r["stage"] == "parse" and r["raised_in"].startswith("megatron/"), r
    assert re.search(MEGATRON_FIRST[case][1], r["message"]), r["message"]
