"""``python -m megatron_trace.plan``: its arguments, table and per-rank rows against the library's numbers."""

import inspect
import json
import re
from pathlib import Path

import pytest

from megatron_trace.cli import plan
from megatron_trace.config import TraceConfig
from megatron_trace.guidance.mismatch_profile import profile_from_metrics
from megatron_trace.guidance.model_dims import ModelDims
from megatron_trace.guidance.planner import RLSettings, plan_row, rank_projection

Q35 = Path(__file__).parent.parent / "data" / "qwen3_5_35b_a3b_like_config.json"


@pytest.mark.parametrize("policy,want", [
    ("none", {"guided_layers": "none"}),
    ("all", {"guided_layers": "all"}),
    ("last_k=3", {"guided_layers": "last_k", "guided_last_k": 3}),
    ("fraction=0.3", {"guided_layers": "fraction", "guided_fraction": 0.3}),
    ("explicit=4,1", {"guided_layers": "explicit", "guided_layer_list": (4, 1)}),
    ("budget=1.5e4", {"guided_layers": "budget", "budget_bytes_per_token": 15000.0}),
])
def test_policy_kwargs(policy, want):
    assert plan.policy_kwargs(policy) == want


@pytest.mark.parametrize("policy", ["all=3", "none=0", "last_k=x", "deepest"])
def test_a_policy_with_a_stray_or_bad_argument_is_refused(policy):
    """``all=3`` used to be taken as ``all`` (the 3 dropped without a word)."""
    with pytest.raises(ValueError, match=f"--layer-policy '{policy}'"):
        plan.policy_kwargs(policy)


def test_defaults_are_the_libraries():
    """The CLI's step is ``RLSettings()``'s and its profile window ``profile_from_metrics``' default."""
    a = plan.parse_args(["--hf-config", "c.json"])
    assert RLSettings(a.trajectories, a.prompt_len, a.response_len, a.bandwidth_gbps, a.steps_in_flight) == RLSettings()
    assert a.mismatch_last == inspect.signature(profile_from_metrics).parameters["last"].default
    assert (a.format, a.amax, a.modes, a.mismatch_unit) == ("nvfp4", "per_row", "full,compact", "rate")


def test_bandwidths_are_named_by_the_text_before_the_last_equals_sign():
    assert plan.parse_bandwidths(["20", "nvlink=100", "ib=hdr=12.5"]) == {"20 GB/s": 20.0, "nvlink": 100.0,
                                                                         "ib=hdr": 12.5}


@pytest.mark.parametrize("extra,err", [
    (["--modes", "compact,compact"], r"--modes \['compact', 'compact'\] gives a value more than once"),
    (["--layer-policy", "all", "--layer-policy", "all"], r"--layer-policy \['all', 'all'\] gives a value"),
    (["--dp-ranks", "2", "--dp-ranks", "2"], r"--dp-ranks \[2, 2\] gives a value more than once"),
    (["--dp-ranks", "2", "--bandwidth-gbytes", "ib=10", "--bandwidth-gbytes", "ib=20"], "names 'ib' twice"),
])
def test_a_value_given_twice_is_refused(extra, err, capsys):
    """Repeated modes, policies or ranks repeated their rows; a repeated bandwidth name kept the later value only."""
    assert plan.main(["--hf-config", str(Q35), *extra]) == 2
    assert re.search(err, capsys.readouterr().err)


@pytest.mark.parametrize("policy", ["explicit=1,1", "explicit=3,1,3,1"])
def test_an_explicit_policy_naming_a_layer_twice_is_refused_as_the_launch_flag_refuses_it(policy, capsys):
    """``explicit=1,1`` was sized as layer 1 alone, exit 0, while ``--trace-guided-layers 1,1`` is refused."""
    from megatron_trace.megatron.args import add_trace_args

    parser = add_trace_args(__import__("argparse").ArgumentParser(exit_on_error=False))
    with pytest.raises(__import__("argparse").ArgumentError, match="given twice"):
        parser.parse_args(["--trace-guided-layers", policy.partition("=")[2]])
    assert plan.main(["--hf-config", str(Q35), "--layer-policy", policy]) == 2
    twice = "1" if policy == "explicit=1,1" else "3, 1"
    assert f"--layer-policy '{policy}': layer(s) {twice} given twice" in capsys.readouterr().err


@pytest.mark.parametrize("extra,err", [
    (["--modes", ""], r"--modes '' names none of \('compact', 'full'\)"),
    (["--modes", ","], r"--modes ',' names none of"),
    (["--sites", ""], r"--sites '' names none of \('expert_fc1_in', 'expert_fc2_in', 'kv_k', 'kv_v'\)"),
], ids=["modes-empty", "modes-comma", "sites-empty"])
def test_an_empty_list_is_refused(extra, err, capsys):
    """An empty ``--modes`` printed a table without rows, an empty ``--sites`` rows of 0 bytes, exit 0."""
    assert plan.main(["--hf-config", str(Q35), *extra]) == 2
    assert re.search(err, capsys.readouterr().err)


def test_the_kv_format_flag_sizes_sglangs_kv_records(capsys):
    """``--kv-format sglang_kvfp4`` sizes the K/V records in SGLang's format (no 4-byte amax per row) and the expert
    sites in ``--format``: the library's row for that TraceConfig (checked against a rollout's records in
    tests/guidance/test_planner_shards.py). Without the flag a planned SGLang run was sized with NVFP4 K/V rows."""
    argv = ["--hf-config", str(Q35), "--json", "--layer-policy", "all", "--modes", "compact", "--trajectories", "2",
            "--dp-ranks", "2"]
    assert plan.main([*argv, "--kv-format", "sglang_kvfp4"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    dims, rl = ModelDims.from_hf_config(Q35), RLSettings(trajectories=2)
    cfg = TraceConfig(kv_format="sglang_kvfp4", guided_layers="all", cache_mode="compact")
    assert row == {**plan_row(dims, cfg, rl, "all"), "per_rank": [rank_projection(dims, cfg, rl, dp_ranks=2)]}
    assert plan.main(argv) == 0
    (nv,) = json.loads(capsys.readouterr().out)["rows"]
    kv_rows = len(dims.kv_layers) * 2 * dims.kv_heads  # K and V rows per token: each 4 amax bytes fewer
    assert nv["bytes_per_token"] - row["bytes_per_token"] == 4 * kv_rows


@pytest.mark.parametrize("n,want", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536 * 2**20, "1.5 GiB"),
                                    (2**50 * 3, "3.0 PiB"), (2**60, "1024.0 PiB")])
def test_human(n, want):
    assert plan.human(n) == want


@pytest.mark.parametrize("s,want", [(0.5, "0.50 s"), (119.5, "119.50 s"), (120, "2.0 min"), (7199, "120.0 min"),
                                    (7200, "2.0 h"), (90000, "25.0 h")])
def test_seconds(s, want):
    assert plan.seconds(s) == want


def test_table_shows_the_json_rows_numbers_and_the_step(capsys):
    """Each column of the table is its JSON row's number, the header line the step as given."""
    argv = ["--hf-config", str(Q35), "--trajectories", "24", "--prompt-len", "100", "--response-len", "3000",
            "--bandwidth-gbps", "25", "--steps-in-flight", "3", "--layer-policy", "fraction=0.5", "--layer-policy",
            "last_k=3"]
    assert plan.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "step: 24 trajectories x (100 + 3000) tokens = 74,400 tokens; link 25 Gbit/s; 3 step(s) in flight" in out
    table = [line.split() for line in out if line.startswith(("fraction=", "last_k="))]
    assert len(table) == len(rows) == 4
    for cells, r in zip(table, rows):
        want = [r["policy"], r["mode"], str(r["num_layers"]), plan.human(r["bytes_per_token"]),
                plan.human(r["bytes_per_step"]), plan.human(r["host_bytes"]), plan.seconds(r["sync_seconds"])]
        assert " ".join(cells) == " ".join(want)
        assert r["host_bytes"] > r["bytes_per_step"]  # the columns discriminate (x 3 steps in flight, side bytes)


def test_the_format_flag_sizes_that_format(capsys):
    assert plan.main(["--hf-config", str(Q35), "--json", "--format", "mxfp4", "--layer-policy", "all",
                      "--modes", "full", "--trajectories", "2"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    dims, rl = ModelDims.from_hf_config(Q35), RLSettings(trajectories=2)
    want = plan_row(dims, TraceConfig(format="mxfp4", guided_layers="all", cache_mode="full"), rl, "all")
    assert row == want
    nv = plan_row(dims, TraceConfig(format="nvfp4", guided_layers="all", cache_mode="full"), rl, "all")
    assert nv["bytes_per_token"] != want["bytes_per_token"]


def test_budget_rows_size_each_rank_for_the_layers_the_budget_chose(tmp_path, capsys):
    """``--dp-ranks`` with a budget policy: each rank's share is of the chosen layers."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps([0.01 * (i % 5 + 1) for i in range(40)]))
    assert plan.main(["--hf-config", str(Q35), "--json", "--layer-policy", "budget=20000", "--mismatch-profile",
                      str(prof), "--modes", "compact", "--trajectories", "16", "--dp-ranks", "4", "--dp-ranks", "8",
                      "--bandwidth-gbytes", "ib=50"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert 0 < len(row["layers"]) < 40
    dims, rl = ModelDims.from_hf_config(Q35), RLSettings(trajectories=16)
    cfg = TraceConfig(guided_layers="explicit", guided_layer_list=tuple(row["layers"]), cache_mode="compact")
    assert row["per_rank"] == [rank_projection(dims, cfg, rl, dp_ranks=n, bandwidths_gbytes={"ib": 50.0})
                               for n in (4, 8)]


@pytest.mark.parametrize("extra,err", [
    (["--mismatch-profile", "{json}"], r"--mismatch-profile \S+profile.json would do nothing: only a --layer-policy "
                                       r"budget=BYTES reads it, and the policies are \['all', 'fraction=0.5'"),
    (["--layer-policy", "all", "--mismatch-profile", "{json}"], r"would do nothing: .* the policies are \['all'\]"),
    (["--mismatch-arm", "fp4_qat"], r"--mismatch-arm fp4_qat would do nothing: .* the profile is not given"),
    (["--layer-policy", "budget=20000", "--mismatch-profile", "{json}", "--mismatch-arm", "fp4_qat"],
     r"--mismatch-arm fp4_qat would do nothing: it picks the rows of a run's metrics.jsonl"),
    (["--mismatch-last", "5"], r"--mismatch-last 5 would do nothing"),
    (["--mismatch-unit", "mass"], r"--mismatch-unit mass would do nothing without a JSON --mismatch-profile"),
], ids=["profile-default-policies", "profile-all", "arm-alone", "arm-json-profile", "last-alone", "unit-alone"])
def test_a_mismatch_flag_that_would_do_nothing_is_refused(extra, err, tmp_path, capsys):
    """A profile without a budget policy, or ``--mismatch-arm`` / ``--mismatch-last`` without a metrics.jsonl profile
    printed the table they would have printed without it, exit 0 (as ``--bandwidth-gbytes`` without ``--dp-ranks``
    is refused); at its default value such a flag is accepted, and with the budget policy the profile is read."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps([0.01 * (i % 5 + 1) for i in range(40)]))
    argv = ["--hf-config", str(Q35), "--modes", "compact", "--json"]
    assert plan.main([*argv, *(str(prof) if a == "{json}" else a for a in extra)]) == 2
    assert re.search(err, capsys.readouterr().err)
    assert plan.main([*argv, "--mismatch-last", "3", "--mismatch-unit", "rate"]) == 0  # (the defaults)
    capsys.readouterr()
    assert plan.main([*argv, "--layer-policy", "budget=20000", "--mismatch-profile", str(prof)]) == 0
    assert json.loads(capsys.readouterr().out)["mismatch_profile"]["values"][:2] == [0.01, 0.02]


def test_a_missing_profile_file_is_an_error_line_not_a_traceback(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert plan.main(["--hf-config", str(Q35), "--layer-policy", "budget=20000", "--mismatch-profile",
                      str(missing)]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_per_rank_lines_show_each_ranks_json_numbers(capsys):
    argv = ["--hf-config", str(Q35), "--layer-policy", "all", "--modes", "compact", "--trajectories", "16",
            "--steps-in-flight", "2", "--dp-ranks", "4", "--bandwidth-gbytes", "ib=50",
            "--bandwidth-gbytes", "nvlink=400"]
    assert plan.main([*argv, "--json"]) == 0
    (p,) = json.loads(capsys.readouterr().out)["rows"][0]["per_rank"]
    assert plan.main(argv) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    h = {k: plan.human(p[f"{k}_bytes_per_rank"]) for k in ("guidance", "routing", "cache_host", "sync_payload")}
    assert len(set(h.values())) == 4  # the line discriminates its fields
    s = p["sync_seconds"]
    assert line == (f"all compact, 4 DP ranks: 4 samples, guidance {h['guidance']}, routing {h['routing']}, host cache "
                    f"{h['cache_host']}, sync payload {h['sync_payload']}; sync {plan.seconds(s['ib'])} @ ib, "
                    f"{plan.seconds(s['nvlink'])} @ nvlink")


@pytest.mark.parametrize("name,mla", [("deepseek_v3", True), ("qwen3_5_35b_a3b_like", False)])
def test_table_says_when_kv_rows_are_an_mla_latent(name, mla, capsys):
    cfg = Q35.parent / f"{name}_config.json"
    assert plan.main(["--hf-config", str(cfg), "--layer-policy", "none", "--modes", "compact"]) == 0
    dims = ModelDims.from_hf_config(cfg)
    assert dims.kv_v != mla  # (MLA caches one latent row per token: K only)
    head = capsys.readouterr().out.splitlines()[0]
    assert head.endswith(f"KV rows {dims.kv_heads}x{dims.head_dim}" + (" (MLA latent, K only)" if mla else ""))


@pytest.mark.parametrize("sites", ["expert_fc1_in", "expert_fc1_in,kv_k,kv_v", "expert_fc1_in,expert_fc2_in,kv_k,kv_v"])
def test_the_launch_flags_printed_for_a_budget_choice_launch_what_was_sized(tmp_path, capsys, sites):
    """The printed flags left out the guided sites: a budget sized for ``--sites expert_fc1_in`` launched guiding all
    four sites on its layers (about 3x the bytes per token the budget chose on this model)."""
    import argparse

    from megatron_trace.guidance.accounting import bytes_per_token
    from megatron_trace.megatron.args import add_trace_args, trace_config_from_args

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps([0.01 * (i % 5 + 1) for i in range(40)]))
    argv = ["--hf-config", str(Q35), "--layer-policy", "budget=6000", "--mismatch-profile", str(prof),
            "--modes", "compact", "--sites", sites]
    assert plan.main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert plan.main(argv) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    flags = line.split(": ", 1)[1].split()
    dims = ModelDims.from_hf_config(Q35)
    args = add_trace_args(argparse.ArgumentParser()).parse_args(["--trace-fp4", *flags])
    args.num_layers, args.num_experts, args.moe_enable_routing_replay = dims.num_layers, 256, True
    launched = trace_config_from_args(args)
    assert launched.guided_sites == tuple(sites.split(",")) and launched.guided_layer_list == tuple(row["layers"])
    assert bytes_per_token(dims, launched.guided_sites, row["layers"]) == row["bytes_per_token"] <= 6000
