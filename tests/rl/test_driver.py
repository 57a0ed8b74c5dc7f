"""The GRPO driver on a micro config: every arm runs, metrics are finite, TRACE lowers the mismatch, resume is exact."""

import dataclasses
import json
import logging
import math
import pathlib
import re
import time

import pytest
import torch
import torch.distributed as dist

from megatron_trace.config import ACTIVATION_SITES, TraceConfig
from megatron_trace.rl import report
from megatron_trace.rl.arms import ARMS, make_arm
from megatron_trace.rl.demo import check_init_from, run
from megatron_trace.rl.driver import GRPORun, RLConfig, keep_for_arm
from megatron_trace.rl.sft import SFTConfig, TinyMoEConfig, sft_checkpoint
from megatron_trace.rl.tasks import AdditionTask, get_task

from ._passes import check_micro_batches_match_one

MODEL = TinyMoEConfig(num_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      num_experts=4, top_k=2, moe_intermediate_size=32)
RL = RLConfig(steps=3, prompts_per_step=4, group_size=4, eval_problems=16, checkpoint_every=0)


@pytest.fixture(scope="module")
def megatron_cpu():
    from megatron_trace.testing.megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    apply_cpu_shims()
    init_megatron(0, 1)
    yield
    shutdown_megatron()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(sft_checkpoint(tmp_path_factory.mktemp("sft"), get_task("add"), MODEL, SFTConfig(steps=5)))


def test_arms_are_trace_config_variants():
    base = TraceConfig()
    assert [make_arm(a, base).rollout_mode for a in ARMS] == ["bf16", "fp4", "fp4", "fp4", "fp4"]
    assert make_arm("trace_full", base).trace.cache_mode == "full"
    assert make_arm("trace", base).trace == base and not make_arm("fp4_qat", base).guided
    with pytest.raises(ValueError, match="arm='int8'"):
        make_arm("int8", base)


def test_all_arms_run_and_trace_removes_mismatch(megatron_cpu, ckpt, tmp_path):
    by_arm = run(out_dir=tmp_path, task_name="add", arms=list(ARMS), trace=TraceConfig(), rl=RL, model=MODEL,
                 sft=SFTConfig(steps=5), init_from=ckpt, progress=False)
    assert set(by_arm) == set(ARMS) and all(len(rows) == RL.steps for rows in by_arm.values())
    for arm, rows in by_arm.items():
        for key in ("reward", "mismatch/logprob_abs_diff", "mismatch/kl_k3", "time/step_s"):
            assert all(math.isfinite(r[key]) for r in rows), (arm, key)
        assert "eval/accuracy" in rows[-1] and rows[-1]["topology/ep"] == 1.0
    mean = lambda arm, k: sum(r[k] for r in by_arm[arm]) / len(by_arm[arm])  # noqa: E731
    d = {arm: mean(arm, "mismatch/logprob_abs_diff") for arm in ARMS}
    # measured on this micro config (CPU, deterministic): naive 4.5e-3 > qat 6.3e-4 > trace 3.1e-4 >= full 2.9e-4,
    # bf16 floor 3.7e-4; the bounds leave room for other CPUs' float summation orders
    assert d["fp4_naive"] > d["fp4_qat"] > d["trace_full"], d
    assert d["trace"] < d["fp4_qat"] and d["trace_full"] < 1.5 * d["bf16"], d
    # full codes on all layers: the trainer reproduces the rollout's codes at every guided site
    assert by_arm["trace_full"][-1]["quant/guided/code_mismatch_rate"] < 1e-3
    assert by_arm["trace"][-1]["cache/bytes_per_token"] < by_arm["trace_full"][-1]["cache/bytes_per_token"]
    for name in ("summary.md", "metrics.jsonl", "reward.png", "mismatch.png", "code_mismatch_per_layer.png"):
        assert (tmp_path / name).exists()
    assert len(report.summary_rows(by_arm)) == 1 + len(ARMS)
    keys = {k for rows in by_arm.values() for r in rows for k in r}
    missing = [name for name in readme_metric_names() if not any(_metric_re(name).fullmatch(k) for k in keys)]
    assert not missing, f"README's metric table names metrics the demo never writes: {missing}"


def readme_metric_names() -> list[str]:
    """The metric names in the first column of README's "Reading the metrics" table; a bare name (``kl_k3``,
    ``{prefill,decode}/*``) takes the prefix of the cell's first name (``mismatch/``), ``sync/*`` is a name."""
    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    table = text.split("## Reading the metrics", 1)[1].split("\n\n")[2]
    names = []
    for line in table.splitlines()[2:]:
        cell = re.findall(r"`([^`]+)`", line.split(" | ")[0])
        prefix = cell[0].split("/", 1)[0] + "/"
        names += [prefix + n if "/" not in n or n.startswith("{") else n for n in cell]
    assert len(names) >= 12, names  # (the table was found)
    return names


def _metric_re(name: str) -> re.Pattern:
    """``<site>`` one path part, ``*`` the rest, ``{a,b}`` either; the demo's guidance counters sit under
    ``guidance/trainer/`` or ``guidance/assembly/`` (as the table says)."""
    pat = re.escape(name).replace(r"\*", ".+")
    pat = re.sub(r"<[^>]+>", "[^/]+", pat)
    pat = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(" + m.group(1).replace(",", "|") + ")", pat)
    return re.compile(pat.replace("guidance/", "guidance/(trainer/|assembly/)?", 1))


def test_a_runs_metrics_give_the_budget_planner_its_per_layer_rates(megatron_cpu, ckpt, tmp_path, capsys):
    """The unguided FP4 arm's per-layer code-mismatch rates in a real demo run's metrics.jsonl are the budget
    policy's profile (``plan --mismatch-profile metrics.jsonl``): each layer's rate is its sites' rates over the
    last steps, weighted by their elements, and a budget of one layer guides the layer that mismatches most."""
    import json
    from pathlib import Path

    from megatron_trace.cli import plan
    from megatron_trace.guidance.accounting import bytes_per_layer
    from megatron_trace.guidance.model_dims import ModelDims

    run(out_dir=tmp_path, task_name="add", arms=["fp4_qat"], trace=TraceConfig(), rl=dataclasses.replace(RL, steps=2),
        model=MODEL, sft=SFTConfig(steps=5), init_from=ckpt, progress=False)
    hf_config = Path(ckpt) / "config.json"
    dims = ModelDims.from_hf_config(hf_config)
    rows = report.load(tmp_path / "metrics.jsonl")["fp4_qat"]
    want = []
    for layer in range(MODEL.num_layers):
        elems = {s: math.prod(dims.site_rows(s)) for s in ACTIVATION_SITES}
        rate = {s: sum(r[f"quant/{s}/layer_{layer}/code_mismatch_rate"] for r in rows) / len(rows) for s in elems}
        want.append(sum(rate[s] * elems[s] for s in elems) / sum(elems.values()))
    assert all(0 < w < 1 for w in want), want  # FP4 QAT with its own rounding mismatches at every layer
    cost = bytes_per_layer(dims, ACTIVATION_SITES, compact=True)
    assert len(set(cost.values())) == 1  # the layers cost the same: the budget of one picks the higher rate
    assert plan.main(["--hf-config", str(hf_config), "--layer-policy", f"budget={cost[0]}", "--modes", "compact",
                      "--mismatch-profile", str(tmp_path / "metrics.jsonl"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mismatch_profile"]["values"] == pytest.approx(want)
    assert res["rows"][0]["layers"] == [max(range(MODEL.num_layers), key=want.__getitem__)]


def test_keep_for_arm_selects_layers_and_compacts(megatron_cpu, ckpt, tmp_path):
    arm = make_arm("trace", TraceConfig())
    r = GRPORun(arm, RL, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    problems, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, 1.0))
    kept = keep_for_arm(batch.guidance, arm, MODEL.num_layers)
    assert {k[0] for k in kept} == {1} and all(sg.compact for sg in kept.values())
    assert {k[0] for k in batch.guidance} == {0, 1}  # the rollout records every layer (metrics superset)



def test_keep_for_arm_ships_the_guided_sites_only():
    """Only the arm's guided sites at its guided layers travel (by hand: layer 1 of 2, expert_fc1_in alone)."""
    from megatron_trace.guidance.site import SiteGuidance

    q = TraceConfig().activation_quantizer()
    sg = SiteGuidance(q.quantize(torch.randn(1, 2, 32)).guidance(compact=False), torch.ones(1, 2, dtype=torch.bool))
    full = {(layer, site): sg for layer in (0, 1) for site in ("expert_fc1_in", "expert_fc2_in", "kv_k")}
    arm = make_arm("trace", TraceConfig(guided_sites=("expert_fc1_in",)))
    assert set(keep_for_arm(full, arm, 2)) == {(1, "expert_fc1_in")}


def test_a_steps_responses_come_in_contiguous_groups_of_one_prompt(megatron_cpu, ckpt, tmp_path):
    """``group_advantages`` normalises contiguous runs of ``group_size`` rewards: the step's prompts must be laid out
    that way (prompt 0 x G, prompt 1 x G, ...), else each "group" mixes prompts and the advantages are wrong."""
    g = 4
    cfg = RLConfig(steps=1, prompts_per_step=3, group_size=g, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("bf16", TraceConfig()), cfg, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    problems, ids = r._prompts(0)
    assert len(problems) == len(ids) == cfg.prompts_per_step * g
    assert all(problems[i] is problems[i - i % g] for i in range(len(problems)))
    assert len({id(p) for p in problems}) == cfg.prompts_per_step
    assert all(ids[i] == r.tok.encode(p.prompt, bos=True) for i, p in enumerate(problems))
    # each step draws its own prompts and sampling seed (a seed without the step trained one batch over and over)
    assert [p.prompt for p in r._prompts(1)[0]] != [p.prompt for p in problems]
    assert r._sampling(1, 1.0).seed != r._sampling(0, 1.0).seed

def test_a_compact_arm_reports_the_bytes_per_token_of_full_records_too(megatron_cpu, ckpt, tmp_path):
    """METRICS.md's ``cache/bytes_per_token`` comes with "the same for full mode": the demo logged only the arm's own
    mode, so a compact run showed no saving. Both now, equal to the bytes of a row (``accounting.row_bytes``) times
    the rows per token of every guided (layer, site)."""
    from megatron_trace.guidance.accounting import row_bytes

    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig(guided_layers="all")), rl, get_task("add"), ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c")
    m = r.step()
    heads, k = MODEL.num_key_value_heads, MODEL.top_k
    per_layer = lambda compact: (row_bytes(MODEL.hidden_size, compact=compact)  # noqa: E731
                                 + k * row_bytes(MODEL.moe_intermediate_size, compact=compact)
                                 + 2 * heads * row_bytes(MODEL.head_dim, compact=compact))
    assert m["cache/bytes_per_token"] == MODEL.num_layers * per_layer(True)
    assert m["cache/bytes_per_token_full"] == MODEL.num_layers * per_layer(False)


def test_resume_reproduces_the_next_step(megatron_cpu, ckpt, tmp_path):
    task, arm = get_task("add"), make_arm("trace", TraceConfig())

    def fresh():
        return GRPORun(arm, RL, task, ckpt, out_dir=tmp_path, cache_dir=tmp_path / "cache")

    straight = fresh()
    ref = [straight.step() for _ in range(3)]
    first = fresh()
    first.step(), first.step()
    first.save(tmp_path / "ck.pt")
    # fields that change how, not what, is computed may change on resume (a budget of 0 spills every sample)
    resumed = GRPORun(make_arm("trace", TraceConfig(cache_budget_mb=0.0, kernel="reference", finite_check="sync")),
                      RL, task, ckpt, out_dir=tmp_path, cache_dir=tmp_path / "cache")
    resumed.load(tmp_path / "ck.pt")
    again = resumed.step()
    assert resumed.cache.peak_host_bytes == 0 and again["guidance/trainer/coverage"] > 0  # all read from disk
    for key in ("reward", "loss", "mismatch/logprob_abs_diff", "mismatch/kl_k3", "guidance/trainer/coverage"):
        assert again[key] == ref[2][key], key
    with pytest.raises(ValueError, match="for arm 'trace' \\(this run's arm is 'fp4_qat'\\)"):
        GRPORun(make_arm("fp4_qat", TraceConfig()), RL, task, ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c2").load(tmp_path / "ck.pt")
    # the TraceConfig field that differs is named (it said "with another TraceConfig": which of two dozen?)
    with pytest.raises(ValueError, match=r"for arm 'trace' with another TraceConfig: rounding: checkpoint='rne' "
                                         r"now='stochastic'$"):
        GRPORun(make_arm("trace", TraceConfig(rounding="stochastic")), RL, task, ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c4").load(tmp_path / "ck.pt")
    torch.testing.assert_close(torch.tensor(again["policy_version"]), torch.tensor(3.0))
    # another task, seed or lr resumed silently: other prompts, and the checkpoint's lr overrode the configured one
    other = GRPORun(arm, dataclasses.replace(RL, seed=7, lr=1e-3, steps=9), get_task("reverse"), ckpt,
                    out_dir=tmp_path, cache_dir=tmp_path / "c3")
    with pytest.raises(ValueError, match=r"of another run: task: checkpoint='add' now='reverse'; seed: checkpoint=0 "
                                         r"now=7; lr: checkpoint=5e-05 now=0.001$"):  # (steps may change)
        other.load(tmp_path / "ck.pt")


def test_loading_an_older_checkpoint_into_a_running_run_rolls_the_rollout_back(megatron_cpu, ckpt, tmp_path):
    """Versions only go up on a step's sync; ``load`` resets the rollout to the checkpoint's (older) version on purpose,
    drops the cached guidance, and the step after it is the checkpoint's next step again."""
    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig()), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    assert r.rollout.policy_version == r.state.version == 0
    r.step()
    r.save(tmp_path / "ck.pt")
    want = r.step()
    assert r.rollout.policy_version == r.state.version == 2
    with pytest.raises(ValueError, match="version=2 is not newer than the rollout's policy_version=2"):
        r._sync_weights()  # a second sync under version 2 (other weights would share its records' version)
    r.load(tmp_path / "ck.pt")
    assert r.rollout.policy_version == r.state.version == 1 and r.cache.steps == []
    again = r.step()
    assert again["policy_version"] == 2.0 and r.rollout.policy_version == 2
    for key in ("reward", "loss", "mismatch/logprob_abs_diff", "guidance/trainer/coverage"):
        assert again[key] == want[key], key


def test_resume_with_stochastic_rounding_redoes_the_step_exactly(megatron_cpu, ckpt, tmp_path):
    """The trainer's stochastic rounding drew from the unseeded global RNG: a resumed step's mismatch differed
    (9.3e-3 straight vs 7.9e-3 resumed on this config)."""
    rl = RLConfig(steps=2, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    arm, task = make_arm("fp4_qat", TraceConfig(rounding="stochastic")), get_task("add")

    def fresh(name):
        return GRPORun(arm, rl, task, ckpt, out_dir=tmp_path / name, cache_dir=tmp_path / f"c{name}")

    straight = fresh("a")
    ref = [straight.step() for _ in range(2)]
    first = fresh("b")
    first.step()
    first.save(tmp_path / "ck.pt")
    torch.rand(7)  # other draws in between
    resumed = fresh("c")
    resumed.load(tmp_path / "ck.pt")
    again = resumed.step()
    for key in ("mismatch/logprob_abs_diff", "mismatch/kl_k3", "loss"):
        assert again[key] == ref[1][key], key


def test_a_run_killed_while_saving_keeps_its_last_checkpoint(tmp_path):
    from types import SimpleNamespace
    from unittest import mock

    from megatron_trace.monitor import TrendAlarm
    from megatron_trace.rl.driver import ArmState

    run_ = SimpleNamespace(state=ArmState(step=5, version=5), trend=TrendAlarm(window=3),
                           arm=make_arm("trace", TraceConfig()), _run_identity=lambda: {},
                           policy=SimpleNamespace(state_dict=lambda: {"model": {"w": torch.ones(8)}}))
    path = tmp_path / "ckpt.pt"
    GRPORun.save(run_, path)

    def killed(obj, f, *args, **kw):  # the job dies after part of the file is written
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04partial")
        raise KeyboardInterrupt

    run_.state.step = 10
    with mock.patch("torch.save", killed), pytest.raises(KeyboardInterrupt):
        GRPORun.save(run_, path)
    assert torch.load(path, weights_only=False)["state"]["step"] == 5  # (it was an unreadable zip)


def test_mismatch_gate_fails_the_step(megatron_cpu, ckpt, tmp_path):
    from megatron_trace.monitor import MismatchGateError

    gated = RLConfig(steps=1, prompts_per_step=2, group_size=2, max_logprob_abs_diff=1e-12)
    r = GRPORun(make_arm("fp4_naive", TraceConfig()), gated, get_task("add"), ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c")
    with pytest.raises(MismatchGateError, match="logprob_abs_diff"):
        r.step()
    assert r.last_metrics["mismatch/logprob_abs_diff"] > 1e-12 and r.state.step == 1
    # the demo writes the failing step's row and the summary of the rows so far, then fails
    with pytest.raises(MismatchGateError):
        run(out_dir=tmp_path / "demo", task_name="add", arms=["fp4_naive"], trace=TraceConfig(), rl=gated,
            model=MODEL, sft=SFTConfig(steps=5), init_from=ckpt, progress=False)
    rows = report.load(tmp_path / "demo" / "metrics.jsonl")["fp4_naive"]
    assert [r["step"] for r in rows] == [0] and (tmp_path / "demo" / "summary.md").exists()


def test_a_sentinel_failure_writes_the_failing_steps_row(megatron_cpu, ckpt, tmp_path):
    """A SentinelError exited the demo with no metrics.jsonl at all (the mismatch gate writes its failing row):
    the sentinel's logprob_abs_diff=0.00164659 > 1e-12 on fp4_naive was in the error message only."""
    from unittest import mock

    from megatron_trace.monitor import SentinelCheck, SentinelError

    real = SentinelCheck.run

    def from_version_1(self, backend, trainer_logprobs):  # the startup sync's check passes: this is about a step's
        return real(self if backend.policy_version else dataclasses.replace(self, max_abs_diff=None), backend,
                    trainer_logprobs)

    gated = RLConfig(steps=1, prompts_per_step=2, group_size=2, sentinel_prompts=2, sentinel_max_abs_diff=1e-12)
    with mock.patch.object(SentinelCheck, "run", from_version_1):
        r = GRPORun(make_arm("fp4_naive", TraceConfig()), gated, get_task("add"), ckpt, out_dir=tmp_path,
                    cache_dir=tmp_path / "c")
        with pytest.raises(SentinelError, match="logprob_abs_diff") as err:
            r.step()
        assert err.value.metrics["sentinel/logprob_abs_diff"] > 1e-12 and r.state.step == 1
        assert r.last_metrics["sentinel/logprob_abs_diff"] == err.value.metrics["sentinel/logprob_abs_diff"]
        assert r.last_metrics["time/sentinel_s"] > 0 and r.cache.steps == []
        with pytest.raises(SentinelError):
            run(out_dir=tmp_path / "demo", task_name="add", arms=["fp4_naive"], trace=TraceConfig(), rl=gated,
                model=MODEL, sft=SFTConfig(steps=5), init_from=ckpt, progress=False)
    rows = report.load(tmp_path / "demo" / "metrics.jsonl")["fp4_naive"]
    assert [r["step"] for r in rows] == [0] and (tmp_path / "demo" / "summary.md").exists()
    assert rows[0]["sentinel/logprob_abs_diff"] > 1e-12 and math.isfinite(rows[0]["mismatch/logprob_abs_diff"])


def test_the_sentinel_runs_after_the_startup_and_resume_syncs(megatron_cpu, ckpt, tmp_path):
    """``sentinel_prompts`` promised a check "after every weight sync", but the reset syncs (startup, resume) had
    none: a bridge or recipe fault there showed only after a step had trained on it."""
    from unittest import mock

    from megatron_trace.monitor import SentinelCheck, SentinelError

    gated = RLConfig(steps=1, prompts_per_step=2, group_size=2, sentinel_prompts=2, sentinel_max_abs_diff=1e-12)
    with pytest.raises(SentinelError, match="after the sync to version 0: logprob_abs_diff="):
        GRPORun(make_arm("fp4_naive", TraceConfig()), gated, get_task("add"), ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c")  # FP4 rollout, BF16 trainer: never within 1e-12
    cfg = RLConfig(steps=2, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=2)
    seen, real = [], SentinelCheck.run

    def counted(self, backend, trainer_logprobs):
        seen.append(backend.policy_version)
        return real(self, backend, trainer_logprobs)

    with mock.patch.object(SentinelCheck, "run", counted):
        r = GRPORun(make_arm("trace", TraceConfig()), cfg, get_task("add"), ckpt, out_dir=tmp_path / "t",
                    cache_dir=tmp_path / "t" / "c")
        r.step()
        r.save(tmp_path / "ck.pt")
        r.step()
        r.load(tmp_path / "ck.pt")
    assert seen == [0, 1, 2, 1]  # startup, step 0's sync, step 1's, the resume's


def test_a_resumed_demo_redoes_the_steps_after_its_checkpoint_once(megatron_cpu, ckpt, tmp_path):
    """Checkpoint at step 2 of 3, then resume: step 2's row is redone, not duplicated, and the trend alarm sees
    the same window as the straight run (it is in the checkpoint)."""
    kw = dict(task_name="add", arms=["trace"], trace=TraceConfig(), model=MODEL, sft=SFTConfig(steps=5),
              init_from=ckpt, progress=False)
    cfg = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, checkpoint_every=2, trend_window=3)
    straight = run(out_dir=tmp_path, rl=cfg, **kw)["trace"]
    assert torch.load(tmp_path / "trace" / "ckpt.pt", weights_only=False)["state"]["step"] == 2  # (of steps 1-3)
    resumed = run(out_dir=tmp_path, rl=cfg, resume=True, **kw)["trace"]
    assert [r["step"] for r in resumed] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"arm 'trace'.s checkpoint .*ckpt.pt is at step 2, past rl.steps=1"):
        run(out_dir=tmp_path, rl=dataclasses.replace(cfg, steps=1), resume=True, **kw)  # (it ran nothing, silently)
    # the accuracy before training with the first row, the final one with the last
    assert ["eval/accuracy_start" in r for r in straight] == [True, False, False]
    assert ["eval/accuracy" in r for r in straight] == [False, False, True]
    assert (tmp_path / "summary.md").read_text().startswith("# TRACE demo: add, 1 arms, 3 RL steps\n")
    for key in ("mismatch/logprob_abs_diff", "mismatch/logprob_abs_diff/slope", "mismatch/logprob_abs_diff/growth",
                "alarm/mismatch_logprob_abs_diff_rising", "reward"):
        assert resumed[2][key] == straight[2][key], key


def test_a_fresh_demo_leaves_no_checkpoint_for_a_later_resume(megatron_cpu, ckpt, tmp_path, caplog):
    """A fresh run in an old run's directory left that run's ckpt.pt behind, and a later resume loaded it: the
    metrics then held steps [0, 2] (step 1 never ran) with the weights of the other run."""
    kw = dict(task_name="add", arms=["trace"], trace=TraceConfig(), model=MODEL, sft=SFTConfig(steps=5),
              init_from=ckpt, progress=False)
    cfg = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, checkpoint_every=2)
    run(out_dir=tmp_path, rl=cfg, **kw)  # an earlier run: checkpoint at step 2
    run(out_dir=tmp_path, rl=dataclasses.replace(cfg, steps=1, checkpoint_every=0), **kw)  # fresh, no checkpoint
    assert not (tmp_path / "trace" / "ckpt.pt").exists()
    with caplog.at_level(logging.WARNING, logger="megatron_trace.rl.demo"):
        resumed = run(out_dir=tmp_path, rl=dataclasses.replace(cfg, checkpoint_every=0), resume=True, **kw)
    assert [r["step"] for r in resumed["trace"]] == [0, 1, 2]
    assert "no checkpoint: arm trace starts from step 0" in caplog.text


def test_time_sync_is_the_weight_sync_alone(megatron_cpu, ckpt, tmp_path):
    """time/sync_s was everything after the optimizer step (the sentinel's generate and trainer pass included):
    2.45 s against the sync's own 0.016 s (sync/bf16/seconds) on the demo's bf16 arm."""
    from unittest import mock

    from megatron_trace.monitor import SentinelCheck

    cfg = RLConfig(steps=1, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=1)
    r = GRPORun(make_arm("bf16", TraceConfig()), cfg, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    real = SentinelCheck.run

    def slow(self, *a, **k):
        time.sleep(0.5)
        return real(self, *a, **k)

    with mock.patch.object(SentinelCheck, "run", slow):
        m = r.step()
    assert m["time/sync_s"] < 0.5, m["time/sync_s"]  # (was 0.60 s: the sentinel's 0.5 s sleep inside)
    assert m["time/sentinel_s"] >= 0.5
    assert m["time/sync_s"] >= m["sync/bf16/seconds"]


def test_a_demo_run_records_what_reproducing_it_needs(tmp_path):
    """The outputs held no package versions or git commit (Hydra's config.yaml has the settings only)."""
    import json

    from megatron_trace.rl.demo import run_record

    run(out_dir=tmp_path, task_name="add", arms=[], trace=TraceConfig(), rl=RL, model=MODEL, sft=SFTConfig(steps=5),
        init_from=None, sft_cache=tmp_path / "sft", progress=False)
    rec = json.loads((tmp_path / "run.json").read_text())
    assert rec["settings"]["rl"]["seed"] == RL.seed and rec["settings"]["sft"]["seed"] == 0
    assert rec["settings"]["model"]["num_layers"] == MODEL.num_layers and rec["settings"]["task"] == "add"
    assert rec["settings"]["trace"] == json.loads(json.dumps(TraceConfig().to_dict()))
    assert rec["versions"]["torch"] in (torch.__version__, torch.__version__.split("+")[0])
    assert rec["versions"]["megatron-core"] and len(rec["runs"]) == 1
    assert rec["git_commit"] == run_record()["git_commit"] and rec["git_dirty"] == run_record()["git_dirty"]


def test_a_resumed_run_appends_its_record_and_a_fresh_one_starts_over(tmp_path):
    from megatron_trace.rl.demo import write_run_record

    write_run_record(tmp_path, task="add", resume=False)
    write_run_record(tmp_path, task="add", resume=True)
    rec = json.loads((tmp_path / "run.json").read_text())
    assert [r["settings"]["resume"] for r in rec["runs"]] == [False, True] and rec["settings"]["resume"] is True
    write_run_record(tmp_path, task="reverse", resume=False)  # a fresh run in the same directory: its own record only
    rec = json.loads((tmp_path / "run.json").read_text())
    assert [(r["settings"]["task"], r["settings"]["resume"]) for r in rec["runs"]] == [("reverse", False)]


def test_the_warm_up_goes_to_sft_cache_when_one_is_given(tmp_path):
    kw = dict(task_name="add", arms=[], trace=TraceConfig(), rl=RL, model=MODEL, sft=SFTConfig(steps=1, batch_size=2),
              progress=False)
    run(out_dir=tmp_path / "out", sft_cache=tmp_path / "cache", **kw)
    assert (tmp_path / "cache" / "config.json").exists() and not (tmp_path / "out" / "sft").exists()
    run(out_dir=tmp_path / "out2", **kw)  # (none: beside the run's outputs)
    assert (tmp_path / "out2" / "sft" / "config.json").exists()


def test_a_reused_warm_up_shows_no_bar_at_zero(tmp_path, capsys):
    """A reused SFT checkpoint left 'SFT warm-up:   0%|  | 0/5' on screen: the warm-up looked skipped."""
    kw = dict(out_dir=tmp_path, task_name="add", arms=[], trace=TraceConfig(), rl=RL, model=MODEL,
              sft=SFTConfig(steps=5), sft_cache=tmp_path / "sft", progress=True)
    run(**kw)
    assert "5/5" in capsys.readouterr().err
    run(**kw)  # reused
    assert "0/5" not in capsys.readouterr().err


def test_the_warm_up_cache_is_reused_on_the_same_device_type_only(tmp_path, caplog):
    """The cache key had no device: sft_checkpoint(device='cuda') returned a warm-up trained on cpu (and the
    reverse), whose weights differ numerically from one trained on the device asked for."""
    import json

    from megatron_trace.rl.sft import sft_reusable

    task, sft, d = get_task("add"), SFTConfig(steps=2), tmp_path / "sft"
    sft_checkpoint(d, task, MODEL, sft, device="cpu")
    assert sft_reusable(d, task, MODEL, sft, "cpu") and sft_reusable(d, task, MODEL, sft)  # (default: cpu)
    assert not sft_reusable(d, task, MODEL, sft, "cuda") and not sft_reusable(d, task, MODEL, sft, "cuda:1")
    stamp = d / "sft_settings.json"
    key = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**key, "device": "cuda"}))  # a warm-up trained on cuda: not reused on cpu
    with caplog.at_level(logging.INFO, logger="megatron_trace.rl.sft"):
        sft_checkpoint(d, task, MODEL, sft, device="cpu")
    assert "other settings (device): training it again" in caplog.text
    assert json.loads(stamp.read_text())["device"] == "cpu"
    old = {k: v for k, v in key.items() if k != "device"} | {"version": 1}  # a stamp written before the device key
    stamp.write_text(json.dumps(old))
    assert not sft_reusable(d, task, MODEL, sft, "cpu")
    with pytest.raises(ValueError, match="device='gpu' is not a torch device"):
        sft_reusable(d, task, MODEL, sft, "gpu")


def test_a_warm_up_killed_while_saving_is_not_reused_under_the_old_settings(tmp_path, monkeypatch):
    """A warm-up with new settings that died after writing its weights (before its stamp) left the old settings' stamp
    beside them: a later run with those settings reused the other warm-up's weights as its own. The old stamp now goes
    before the save, so that run trains its own again. (transformers' save_pretrained stands in for the kill.)"""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    from megatron_trace.rl.sft import sft_reusable

    task, d, old, new = get_task("add"), tmp_path / "sft", SFTConfig(steps=2), SFTConfig(steps=3)
    want = load_file(sft_checkpoint(d, task, MODEL, old) / "model.safetensors")
    save = Qwen3MoeForCausalLM.save_pretrained

    def killed(self, *args, **kwargs):
        save(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Qwen3MoeForCausalLM, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        sft_checkpoint(d, task, MODEL, new)
    monkeypatch.undo()
    assert not sft_reusable(d, task, MODEL, old) and not sft_reusable(d, task, MODEL, new)
    got = load_file(sft_checkpoint(d, task, MODEL, old) / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert sft_reusable(d, task, MODEL, old)


def test_the_sentinel_is_guided_like_the_step(megatron_cpu, ckpt, tmp_path):
    """fallback='fail' and min_coverage hold for the sentinel's pass too: it is guided by its own rollout."""
    cfg = RLConfig(steps=1, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=2)
    r = GRPORun(make_arm("trace", TraceConfig(fallback="fail", min_coverage=0.99)), cfg, get_task("add"), ckpt,
                out_dir=tmp_path, cache_dir=tmp_path / "c")
    m = r.step()
    assert m["guidance/trainer/coverage"] == 1.0 and math.isfinite(m["sentinel/logprob_abs_diff"])
    assert r.cache.steps == []


@pytest.mark.parametrize("kw,match", [
    (dict(steps=0), "steps=0 must be an int >= 1"), (dict(group_size=0), "group_size=0"),
    (dict(group_size=1), r"group_size=1 must be an int >= 2 \(a group of one response has advantage 0"),
    (dict(sentinel_prompts=-2), "sentinel_prompts=-2 must be an int >= 0"),
    (dict(checkpoint_every=-1), "checkpoint_every=-1"), (dict(kl_coef=0.1), "keeps no reference policy"),
    (dict(weight_sync="int4"), "weight_sync='int4' must be one of"), (dict(lr=0.0), "lr=0.0 must be > 0"),
    (dict(trend_max_slope=float("nan")), "trend_max_slope=nan must be a finite number"),
    (dict(trend_mode="slope"), r"RLConfig.trend_mode='slope' must be one of \('relative', 'absolute'\)"),
    (dict(trend_max_growth=-1.0), "RLConfig.trend_max_growth=-1.0 must be a finite number >= 0"),
    (dict(trend_min_level=0.0), "RLConfig.trend_min_level=0.0 must be a finite number > 0"),
    (dict(trend_mode="relative", trend_max_slope=0.01),
     "RLConfig.trend_max_slope=0.01 is the absolute mode's threshold: set RLConfig.trend_mode='absolute'"),
    (dict(trend_mode="absolute"), "RLConfig.trend_max_slope=None must be a finite number"),
    # were accepted: a YAML true as 1.0 (tis_cap=true capped the IS ratio at 1; a gate at 1.0), an infinite lr;
    # a string ended in a bare "'>' not supported between instances of 'str' and 'int'"
    (dict(tis_cap=True), r"RLConfig.tis_cap=True must be a finite number or None \(off\)"),
    (dict(max_logprob_abs_diff=True), r"RLConfig.max_logprob_abs_diff=True must be a finite number or None"),
    (dict(sentinel_max_abs_diff=True), r"RLConfig.sentinel_max_abs_diff=True must be a finite number or None"),
    (dict(lr=True), "RLConfig.lr=True must be a finite number"),
    (dict(lr=float("inf")), "RLConfig.lr=inf must be a finite number"),
    (dict(lr="5e-5"), "RLConfig.lr='5e-5' must be a finite number"),
    (dict(clip_eps=None), "RLConfig.clip_eps=None must be a finite number"),
    # were accepted: a Hydra override rl.routing_replay=off is the string 'off' (truthy: R3 stayed on), None or 0
    # turned it off; compile_rollout / static_decode typos were refused only by the rollout, after the warm-up
    (dict(routing_replay="off"), r"RLConfig.routing_replay='off' must be a bool \(true / false\)"),
    (dict(routing_replay=None), "RLConfig.routing_replay=None must be a bool"),
    (dict(fast_kv_attention="false"), "RLConfig.fast_kv_attention='false' must be a bool"),
    (dict(fast_kv_attention=0), "RLConfig.fast_kv_attention=0 must be a bool"),
    (dict(compile_rollout="moduels"), r"RLConfig.compile_rollout='moduels' must be one of \(False, True, 'modules'"),
    (dict(compile_rollout=1), "RLConfig.compile_rollout=1 must be one of"),
    (dict(static_decode="on"), r"RLConfig.static_decode='on' must be one of \('auto', 'off', 'eager', 'graph'\)"),
    (dict(static_decode=True), "RLConfig.static_decode=True must be one of"),
])
def test_bad_rl_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        RLConfig(**kw)


def test_an_old_trend_setting_still_selects_the_absolute_alarm():
    """A config of before session 41 sets trend_max_slope only: it keeps the absolute alarm."""
    from megatron_trace.monitor import check_trend_settings

    def mode(cfg: RLConfig) -> str:
        return check_trend_settings(mode=cfg.trend_mode, max_slope=cfg.trend_max_slope,
                                    max_growth=cfg.trend_max_growth, min_level=cfg.trend_min_level)

    assert mode(RLConfig(trend_max_slope=0.01)) == "absolute" and mode(RLConfig()) == "relative"
    assert mode(RLConfig(trend_mode="absolute", trend_max_slope=0.01)) == "absolute"


@pytest.mark.parametrize("kw,match", [
    # were taken: a Hydra override resume=no is the string 'no' (truthy: a resumed run), an arm given twice ran once
    # while the summary counted two, one arm name as a string was read as its letters
    (dict(resume="no"), r"\{'resume': 'no'\} must be bools \(true / false\)"),
    (dict(progress="off"), r"\{'progress': 'off'\} must be bools"),
    (dict(arms=["bf16", "bf16"]), r"arms=\['bf16', 'bf16'\] must be a list of distinct arm names"),
    (dict(arms="bf16"), r"arms='bf16' must be a list of distinct arm names"),
    # were refused once the arm's rollout or trainer was built: after the SFT warm-up (minutes with the demo's
    # settings) and every arm before it ran; a bad task after the output directory and its run.json were written
    (dict(arms=["bf16", "trace"], trace=TraceConfig(guided_layers="last_k", guided_last_k=5)),
     "guided_last_k=5 exceeds num_layers=2"),
    (dict(arms=["trace"], trace=TraceConfig(guided_layers="explicit", guided_layer_list=(7,))),
     r"guided_layer_list has layer\(s\) \[7\] beyond num_layers=2"),
    (dict(arms=["trace"], trace=TraceConfig(guided_layers="budget", budget_bytes_per_token=100.0)),
     "the budget layer policy needs mismatch_profile"),
    (dict(trace=TraceConfig(exclude_modules=("model.layers.9.*",))), r"pattern 'model.layers.9.\*' matches none"),
    (dict(task_name="add7"), r"task='add7' is not one of \['add', 'add5', 'reverse'\]"),
], ids=["resume-str", "progress-str", "arm-twice", "arms-str", "last-k-past-model", "layer-past-model", "budget",
        "exclude-nothing", "task"])
def test_bad_demo_arguments_are_refused_before_any_work(tmp_path, kw, match):
    args = dict(out_dir=tmp_path / "demo", task_name="add", arms=["bf16"], trace=TraceConfig(), rl=RL, model=MODEL,
                sft=SFTConfig(steps=1), progress=False)
    with pytest.raises(ValueError, match=match):
        run(**{**args, **kw})
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("cls,kw,match", [
    # were: ZeroDivisionError; an embedding dtype error; 'selected index k out of range' (both after the model
    # was built); a TypeError about fused experts after the whole warm-up; label_noise=1.5 silently accepted
    (SFTConfig, dict(steps=0), "SFTConfig.steps=0 must be an int >= 1"),
    (SFTConfig, dict(batch_size=0), "SFTConfig.batch_size=0 must be an int >= 1"),
    (SFTConfig, dict(label_noise=1.5), r"SFTConfig.label_noise=1.5 must be in \[0, 1\]"),
    (SFTConfig, dict(lr=0.0), "SFTConfig.lr=0.0 must be > 0"),
    (TinyMoEConfig, dict(top_k=9), "TinyMoEConfig.top_k=9 must be <= num_experts=8"),
    (TinyMoEConfig, dict(num_layers=0), "TinyMoEConfig.num_layers=0 must be an int >= 1"),
    (TinyMoEConfig, dict(num_attention_heads=3, num_key_value_heads=2), "num_attention_heads=3 must be a multiple"),
])
def test_bad_model_and_warm_up_settings_are_named(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def test_greedy_rollouts_are_warned_about(caplog):
    """temperature=0 is valid (evaluation, tests) but a GRPO run of it learns nothing: it says so."""
    with caplog.at_level(logging.WARNING, logger="megatron_trace.rl.driver"):
        RLConfig(temperature=1.0)
        assert not caplog.records
        RLConfig(temperature=0)
    assert "every advantage is 0" in caplog.text


def test_bad_demo_arguments_fail_before_any_work(tmp_path):
    kw = dict(out_dir=tmp_path, task_name="add", trace=TraceConfig(), rl=RL, model=MODEL, sft=SFTConfig(steps=5),
              progress=False)
    with pytest.raises(ValueError, match="arm='trcae'"):
        run(arms=["bf16", "trcae"], init_from=str(tmp_path), **kw)
    with pytest.raises(ValueError, match="device='gpu' must be one of"):
        run(arms=["bf16"], device="gpu", **kw)
    with pytest.raises(FileNotFoundError, match="not a HF checkpoint directory"):
        run(arms=["bf16"], init_from=str(tmp_path / "nowhere"), **kw)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_init_from_another_vocabulary_fails_before_any_work(tmp_path, ckpt):
    """The demo's tasks, rewards and sentinel prompts are its character tokenizer's ids: a checkpoint over another
    vocabulary was accepted and failed only at the first reward (a bare IndexError, after the trainer was built)."""
    from pathlib import Path

    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 200}))
    out = tmp_path / "out"
    kw = dict(out_dir=out, task_name="add", trace=TraceConfig(), rl=RL, model=MODEL, sft=SFTConfig(steps=5),
              progress=False)
    with pytest.raises(ValueError, match=r"init_from=.*other' has vocab_size=200, not the demo's character "
                                         r"vocabulary of 16 tokens"):
        run(arms=["bf16"], init_from=str(other), **kw)
    assert not out.exists()
    del cfg["vocab_size"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has vocab_size=None"):
        run(arms=["bf16"], init_from=str(other), **kw)
    check_init_from(ckpt)  # the demo's own SFT checkpoint passes


def test_resume_invalidates_guidance_of_the_interrupted_step(megatron_cpu, ckpt, tmp_path):
    from megatron_trace.guidance.records import split_batch

    r = GRPORun(make_arm("trace", TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    r.step()
    r.save(tmp_path / "ck.pt")
    # the run is interrupted after the rollout of step 1 stored its guidance, before training on it
    problems, ids = r._prompts(1)
    batch = r.rollout.generate(ids, r._sampling(1, 1.0))
    r.cache.put(1, split_batch(keep_for_arm(batch.guidance, r.arm, MODEL.num_layers), batch.tokens,
                               version=batch.policy_version, attention_mask=batch.attention_mask))
    assert r.cache.steps == [1]
    r.load(tmp_path / "ck.pt")
    assert r.cache.steps == []  # never reused after the restart
    assert r.state.step == 1 and r.rollout.policy_version == 1


def test_a_failed_sync_is_retried_before_the_next_rollout(megatron_cpu, ckpt, tmp_path):
    """A weight sync that raised after the optimizer stepped left the step counter behind: the next step() re-trained
    the same prompts on the stepped weights, from a rollout still serving the older version (whose guidance was
    then rejected). The step now counts once trained, and the next step() retries the sync before rolling out."""
    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig()), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    assert r.step()["guidance/assembly/coverage"] == 1.0

    def dies(*args, **kwargs):
        raise RuntimeError("the transport died")

    r.rollout.update_weights = dies
    with pytest.raises(RuntimeError, match="the transport died"):
        r.step()
    assert (r.rollout.policy_version, r.state.version, r.state.step) == (1, 2, 2)  # step 1 trained, not served
    with pytest.raises(RuntimeError, match="the transport died"):
        r.step()  # the retry raises again, before any rollout or training
    assert (r.rollout.policy_version, r.state.version, r.state.step) == (1, 2, 2)
    del r.rollout.update_weights
    m = r.step()  # step 2's prompts, on version 2's weights
    assert m["guidance/assembly/coverage"] == 1.0 and m.get("guidance/assembly/fallback/version", 0.0) == 0.0
    assert (r.rollout.policy_version, r.state.version, r.state.step) == (3, 3, 3)


def test_a_step_that_raised_in_training_can_be_retried(megatron_cpu, ckpt, tmp_path):
    """A step that raised after its guidance went into the cache (here: fallback='fail' refusing the records of a
    rollout left on another version) kept that guidance held (memory, spilled shards) and every retry of step()
    raised "step 0 already has sample id(s)": the run could not go on. The retry now stores its own records."""
    from megatron_trace.bridge import sync_weights
    from megatron_trace.megatron import GuidanceFallbackError

    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig(fallback="fail", cache_budget_mb=0)), rl, get_task("add"), ckpt,
                out_dir=tmp_path, cache_dir=tmp_path / "c")
    reset = dict(fmt=r.sync_fmt, quantizer=r.arm.trace.weight_quantizer(), reset=True)
    sync_weights(r.rollout, r.policy.export_hf_weights(), version=5, recipe=r.recipe.with_weight_version(5), **reset)
    with pytest.raises(GuidanceFallbackError):
        r.step()  # the records carry version 5, the trainer holds version 0
    assert r.state.step == 0 and r.cache.steps == [0]
    sync_weights(r.rollout, r.policy.export_hf_weights(), version=0, recipe=r.recipe.with_weight_version(0), **reset)
    m = r.step()
    assert m["guidance/assembly/coverage"] == 1.0 and m["guidance/trainer/coverage"] == 1.0
    assert r.state.step == 1 and r.cache.steps == [] and not list((tmp_path / "c").glob("*.safetensors"))


def test_guidance_of_a_rollout_left_on_an_older_version_is_rejected(megatron_cpu, ckpt, tmp_path):
    """Records must carry the trainer's version: a rollout serving another (here set back by a reset sync behind the
    driver's back) had its records accepted, as they were checked against the batch's own version."""
    from megatron_trace.bridge import sync_weights

    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig()), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    r.step()
    sync_weights(r.rollout, r.policy.export_hf_weights(), fmt=r.sync_fmt, quantizer=r.arm.trace.weight_quantizer(),
                 version=0, reset=True, recipe=r.recipe.with_weight_version(0))
    m = r.step()
    assert m["guidance/assembly/coverage"] == 0.0 and m["guidance/trainer/coverage"] == 0.0
    assert m["guidance/assembly/rows_used"] == 0.0 and m["guidance/assembly/fallback/version"] > 0
    assert r.rollout.policy_version == r.state.version == 2
    assert r.step()["guidance/assembly/coverage"] == 1.0  # in step again


@pytest.mark.parametrize("change, match", [
    (dict(num_layers=3), r"checkpoint of another model: .* decoder\.layers\.2\..*nothing was loaded"),
    (dict(top_k=3), r"checkpoint .*ck\.pt computes another model .*: moe_router_topk=3 \(saved: 2\) \(HF config fields "
                    r"that differ: \['num_experts_per_tok'\]\)"),
], ids=["deeper", "top_k"])
def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(megatron_cpu, ckpt, tmp_path, change,
                                                                            match):
    """The trainer loaded a checkpoint with ``strict=False``: a 2-layer run's checkpoint went into a 3-layer run's
    layers 0-1, then the optimizer's master copies failed on a shape (a bare size error), the model half loaded. A
    model of the same shapes but another top-k (an ``init_from`` of another config.json) resumed silently: the weights
    trained under top-2 then routed to three experts."""
    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    arm, task = make_arm("trace", TraceConfig()), get_task("add")
    r = GRPORun(arm, rl, task, ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    r.step()
    r.save(tmp_path / "ck.pt")
    changed = sft_checkpoint(tmp_path / "sft3", task, dataclasses.replace(MODEL, **change), SFTConfig(steps=1))
    other = GRPORun(arm, rl, task, str(changed), out_dir=tmp_path, cache_dir=tmp_path / "c3")
    before = {k: v.clone() for k, v in other.policy.model.state_dict().items() if v is not None}
    with pytest.raises(ValueError, match=match):
        other.load(tmp_path / "ck.pt")
    after = other.policy.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()) and other.state.step == 0


@pytest.mark.parametrize("preset", ["floor", "experts_only", "guidance_on_replay_on", "guidance_on_replay_off",
                                    "guidance_off_replay_on", "guidance_off_replay_off"])
def test_ablation_presets_compose(preset):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from megatron_trace.config import from_hydra, register_hydra

    register_hydra()
    conf = Path(__file__).resolve().parents[2] / "examples" / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("demo", overrides=[f"+preset={preset}"])
    assert cfg.run_name == preset and set(cfg.arms) <= set(ARMS)
    RLConfig(**cfg.rl), from_hydra(cfg.trace)  # both validate
    assert cfg.rl.routing_replay == ("replay_off" not in preset)
    assert (cfg.rl.trend_mode, cfg.rl.trend_max_growth, cfg.rl.trend_max_slope) == ("relative", None, None)


def test_the_demo_switches_to_the_absolute_alarm_with_the_two_overrides_its_config_names():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from megatron_trace.config import register_hydra
    from megatron_trace.monitor import TrendAlarm

    register_hydra()
    conf = Path(__file__).resolve().parents[2] / "examples" / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("demo", overrides=["rl.trend_mode=absolute", "rl.trend_max_slope=0.01"])
    rl = RLConfig(**cfg.rl)
    alarm = TrendAlarm(window=rl.trend_window, mode=rl.trend_mode, max_growth=rl.trend_max_growth,
                       max_slope=rl.trend_max_slope, min_level=rl.trend_min_level)
    assert (alarm.mode, alarm.max_slope, alarm.max_growth) == ("absolute", 0.01, None)
    assert TrendAlarm(mode=None, max_growth=None).max_growth == 1.0  # the yaml's null: the relative default


def test_driver_registers_and_checks_the_quant_recipe(megatron_cpu, ckpt, tmp_path):
    import dataclasses

    from megatron_trace.manifest import RecipeMismatchError

    r = GRPORun(make_arm("trace", TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    assert r.rollout.trainer_recipe == r.recipe and r.recipe.format == "nvfp4"
    assert (r.trend.mode, r.trend.max_growth, r.trend.window) == ("relative", 1.0, RL.trend_window)  # the default
    with pytest.raises(RecipeMismatchError, match="activation_amax: trainer='per_tensor'"):
        r.rollout.check_recipe(dataclasses.replace(r.recipe, activation_amax="per_tensor"))
    assert GRPORun(make_arm("fp4_naive", TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path,
                   cache_dir=tmp_path / "c2").recipe is None  # mixed numerics on purpose: nothing to check


def test_sglang_kv_format_records_guide_the_trainer_exactly(megatron_cpu, ckpt, tmp_path):
    """kv_format='sglang_kvfp4' end to end: the hf rollout stores and records K/V in SGLang's format, the records
    pass the guidance cache and guide the Megatron trainer's KV site: no KV code or scale differs (the NVFP4
    trace_full arm above asserts < 1e-3 over all guided sites), no row falls back."""
    arm = make_arm("trace_full", TraceConfig(kv_format="sglang_kvfp4"))
    rl = RLConfig(steps=1, prompts_per_step=2, group_size=2, eval_problems=4, checkpoint_every=0)
    r = GRPORun(arm, rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")  # recipes agree
    assert r.recipe.kv_format == "sglang_kvfp4" == r.rollout.recipe().kv_format
    problems, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, 1.0))
    assert {sg.record.fmt for (_, site), sg in batch.guidance.items() if site.startswith("kv_")} == {"sglang_kvfp4"}
    m = r.step()
    for site in ("kv_k", "kv_v"):
        assert m[f"quant/{site}/code_mismatch_rate"] == 0.0 and m[f"quant/{site}/scale_mismatch_rate"] == 0.0
        assert m[f"guidance/trainer/coverage/{site}"] == 1.0
    assert m["quant/guided/code_mismatch_rate"] < 1e-3
    assert m["guidance/trainer/coverage"] == 1.0 and "guidance/trainer/fallback/format" not in m


KV_ONLY = dict(sites=("kv_k", "kv_v"), guided_sites=("kv_k", "kv_v"))


@pytest.mark.parametrize("trace", [dict(rounding="stochastic"), dict(format="mxfp4", rounding="stochastic"), KV_ONLY,
                                   dict(sites=("expert_fc1_in", "expert_fc2_in"), guided_sites=("expert_fc1_in",))],
                         ids=["stochastic", "mxfp4-stochastic", "kv-only", "expert-inputs-only"])
def test_a_guided_arm_keeps_the_promise_across_accepted_configs(megatron_cpu, ckpt, tmp_path, trace):
    """trace_full on configs the TraceConfig accepts: the rollout rounds RNE (its records equal an RNE rollout's, bit
    for bit), every guided row is used, the guided sites alone are counted, no scale differs.
    Without the fixes: ``rounding`` (the trainer's own where unguided) made the hf rollout round stochastically too
    (59-87% of its recorded codes differed from RNE's, its recipe said rollout_rounding='rne'); sites without
    "weights" (an FP4 KV cache alone) raised at startup: weight_sync='auto' sent FP4 weights to BF16 experts; a
    quantized site outside guided_sites had no quant/* metrics (the rollout recorded the guided sites alone)."""
    from megatron_trace.rollout.hf import HFRolloutBackend

    cfg = TraceConfig(**trace)
    rl = RLConfig(steps=1, prompts_per_step=2, group_size=2, eval_problems=4, checkpoint_every=0, sentinel_prompts=0)
    r = GRPORun(make_arm("trace_full", cfg), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    rne = HFRolloutBackend(ckpt, mode="fp4", trace_config=r.rollout.config.replace(rounding="rne"))
    _, ids = r._prompts(0)
    got, want = (be.generate(ids, r._sampling(0, 1.0)) for be in (r.rollout, rne))
    assert torch.equal(got.tokens, want.tokens) and set(got.guidance) == set(want.guidance)
    for key, sg in got.guidance.items():
        assert torch.equal(sg.record.codes, want.guidance[key].record.codes), key
        assert torch.equal(sg.record.block_scales.view(torch.uint8), want.guidance[key].record.block_scales.view(
            torch.uint8)), key
    m = r.step()
    guided = set(cfg.guided_sites)
    quantized = {s for s in ACTIVATION_SITES if s in cfg.sites}  # every one compared with the rollout, guided or not
    assert {k.split("/")[1] for k in m if k.startswith("quant/") and k.count("/") == 2
            and k.endswith("/code_mismatch_rate")} == quantized | {"guided"}
    assert {k.rsplit("/", 1)[1] for k in m if k.startswith("guidance/trainer/coverage/")} == guided
    assert all(m[f"guidance/trainer/coverage/{s}"] == 1.0 and m[f"quant/{s}/scale_mismatch_rate"] == 0.0
               for s in guided)
    assert m["guidance/trainer/coverage"] == 1.0 == m["guidance/assembly/coverage"]
    assert not [k for k in m if "/fallback/" in k] and m["guidance/trainer/rows_used"] > 0
    assert m["quant/guided/code_mismatch_rate"] < 1e-3 and math.isfinite(m["loss"])
    if "weights" not in cfg.sites:  # packed FP4 weights for the rollout's BF16 experts: refused by name
        with pytest.raises(ValueError, match="weight_sync='fp4' sends packed FP4 expert weights"):
            GRPORun(r.arm, dataclasses.replace(rl, weight_sync="fp4"), get_task("add"), ckpt, out_dir=tmp_path / "b",
                    cache_dir=tmp_path / "cb")


def test_the_trainer_scores_at_the_sampling_temperature(megatron_cpu, ckpt, tmp_path):
    """The rollout's log-probs are log_softmax(logits / T): at T=0.7 the BF16 arm's mismatch stays at the BF16
    noise level (without /T in the trainer it was ~100x larger)."""
    diffs = {}
    for t in (1.0, 0.7):
        cfg = RLConfig(steps=1, prompts_per_step=4, group_size=2, eval_problems=4, temperature=t, sentinel_prompts=0)
        r = GRPORun(make_arm("bf16", TraceConfig()), cfg, get_task("add"), ckpt, out_dir=tmp_path / str(t),
                    cache_dir=tmp_path / f"c{t}")
        diffs[t] = r.step()["mismatch/logprob_abs_diff"]
    assert diffs[0.7] < 5 * diffs[1.0] + 1e-3, diffs
    with pytest.raises(ValueError, match="temperature=1e-06 must be 0 \\(greedy\\) or >= 1e-05"):
        RLConfig(temperature=1e-6)


@pytest.mark.parametrize("arm", ["bf16", "trace_full"])
def test_micro_batches_through_megatrons_schedule_match_one(megatron_cpu, ckpt, tmp_path, arm):
    check_micro_batches_match_one(GRPORun(make_arm(arm, TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path,
                                          cache_dir=tmp_path / "c"))

@pytest.mark.parametrize("arm", ["trace", "trace_full"])
def test_a_micro_batched_step_reports_what_one_micro_batch_does(megatron_cpu, ckpt, tmp_path, arm):
    """A step over 4 micro-batches (the experts' weights fake-quantized once for all: ``reuse_weight_quant``)
    reports the one-micro-batch step's metrics: guidance counts and coverage, per-site code and scale mismatch
    (summed over the micro-batches' records), train-rollout mismatch, loss and stats."""
    rows = {}
    for mbs in (0, 4):
        cfg = dataclasses.replace(RL, steps=1, micro_batch_size=mbs)
        r = GRPORun(make_arm(arm, TraceConfig()), cfg, get_task("add"), ckpt, out_dir=tmp_path / str(mbs),
                    cache_dir=tmp_path / f"c{mbs}")
        rows[mbs] = r.step()
        assert r.cache.steps == []
    one, four = rows[0], rows[4]
    assert (one["trainer/micro_batches"], four["trainer/micro_batches"]) == (1.0, 4.0)
    assert four["guidance/trainer/coverage"] == 1.0 and any(k.startswith("quant/") for k in four)
    skip = ("time/", "sync/", "trainer/micro_batches", "grad_norm")  # timings; grad_norm: bf16 sums (tested above)
    keys = {k for k in one if not k.startswith(skip)}
    assert keys == {k for k in four if not k.startswith(skip)}
    # d_act_rel is the root of float sums that the micro-batches add in another order: equal up to rounding (bit for
    # bit on some CPUs, 1 ulp apart on an AVX2-only EPYC); every count and rate from counts is exact
    rounded = lambda k: k.endswith("/d_act_rel") and math.isclose(one[k], four[k], rel_tol=1e-12)  # noqa: E731
    differ = {k: (one[k], four[k]) for k in keys
              if one[k] != four[k] and not (one[k] != one[k] and four[k] != four[k]) and not rounded(k)}
    assert not differ, differ
    with pytest.raises(ValueError, match=r"micro_batch_size=3 must be 0 \(the whole batch in one micro-batch\) or a "
                                         r"divisor of prompts_per_step \* group_size = 16"):
        dataclasses.replace(RL, micro_batch_size=3)


def test_a_stock_model_given_no_routing_routes_itself(megatron_cpu, ckpt, tmp_path):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_trace.rl.trainer import replay_routing

    r = GRPORun(make_arm("bf16", TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    _, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, 1.0))
    tokens, other = batch.tokens[:4], {k: v[4:8] for k, v in batch.routing.items()}  # other samples' routing
    with torch.no_grad():
        own = r.policy.logprobs(tokens)
        with replay_routing(r.policy.model) as replay:
            replay(other)
            replay(other)  # (a micro-batch each: Megatron's backward list, unread with REPLAY_FORWARD, keeps none)
            wrong = r.policy.logprobs(tokens)
            lists = [len(m.router.router_replay.replay_backward_list) for m in r.policy.model.modules()
                     if isinstance(m, MoELayer)]
            replay({})
            after = r.policy.logprobs(tokens)
    assert not torch.equal(wrong, own) and torch.equal(after, own)
    assert lists and set(lists) == {0}


def test_a_stock_models_replay_gives_each_row_its_own_routing(megatron_cpu, ckpt, tmp_path):
    """Rows and their routing permuted together: the log-probs are permuted the same way (routing [B, S, topk] laid
    out in Megatron's [S, B] token order); a routing without one of the MoE layers is refused by name."""
    from megatron_trace.rl.trainer import replay_routing

    r = GRPORun(make_arm("bf16", TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    _, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, 1.0))
    tokens, routing, perm = batch.tokens[:4], {k: v[:4] for k, v in batch.routing.items()}, [2, 0, 3, 1]
    assert tokens.shape[1] != tokens.shape[0]
    with torch.no_grad():
        with replay_routing(r.policy.model, routing):
            want = r.policy.logprobs(tokens)
        with replay_routing(r.policy.model, {k: v[perm] for k, v in routing.items()}):
            got = r.policy.logprobs(tokens[perm])
        torch.testing.assert_close(got, want[perm], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match=r"routing indices are missing for MoE layers \[1\]"):
            with replay_routing(r.policy.model, {0: routing[0]}):
                pass


@pytest.mark.parametrize("arm", ["bf16", "fp4_qat"])
def test_trace_routing_replay_off_turns_replay_off_in_every_arm(megatron_cpu, ckpt, tmp_path, arm):
    """trace.routing_replay=false: the stock (bf16, fp4_naive) arms replayed the rollout's routing all the same,
    the FP4 QAT arms did not (a warning each step): an ablation with R3 in half of its arms."""
    rl = RLConfig(steps=1, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm(arm, TraceConfig(routing_replay=False)), rl, get_task("add"), ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c")
    _, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, 1.0))
    assert set(batch.routing) == {0, 1}
    (sg,), _, _ = r._guidance(0, batch, batch.guidance)
    assert sg.routing == {}


def test_fc2_quant_metrics_compare_slots_of_the_same_expert(megatron_cpu, ckpt, tmp_path):
    """Routing replay off: a trainer's FC2 slot may hold another expert's row than the rollout's slot. Such slots
    were compared all the same (the matrix audit saw FC2 scale mismatch up to 8% where every slot of the same
    expert followed its record). Here slot (0, 1, 1) holds another expert, with other values, on the trainer side."""
    from megatron_trace.guidance.site import SiteGuidance
    from megatron_trace.megatron import StepGuidance

    r = GRPORun(make_arm("trace_full", TraceConfig(routing_replay=False)), RL, get_task("add"), ckpt,
                out_dir=tmp_path, cache_dir=tmp_path / "c")
    q, gen = TraceConfig().activation_quantizer(), torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 32, generator=gen)
    ids = torch.randint(0, 4, (2, 3, 2), generator=gen)
    other_x, other_ids = x.clone(), ids.clone()
    other_x[0, 1, 1] = torch.randn(32, generator=gen)
    other_ids[0, 1, 1] += 4
    valid = torch.ones(2, 3, 2, dtype=torch.bool)
    key = (1, "expert_fc2_in")
    rollout = {key: SiteGuidance(q.quantize(x).guidance(compact=False), valid, ids)}
    trainer = StepGuidance(sites={key: SiteGuidance(q.quantize(other_x).guidance(compact=False), valid, other_ids)})
    m = r._quant_metrics([trainer], rollout, 2)
    assert m["quant/expert_fc2_in/scale_mismatch_rate"] == 0.0 and m["quant/expert_fc2_in/code_mismatch_rate"] == 0
    same = StepGuidance(sites={key: SiteGuidance(q.quantize(other_x).guidance(compact=False), valid, ids)})
    assert r._quant_metrics([same], rollout, 2)["quant/expert_fc2_in/scale_mismatch_rate"] > 0  # (compared)


def test_micro_batches_that_do_not_split_the_batch_are_named(megatron_cpu, ckpt, tmp_path):
    r = GRPORun(make_arm("trace", TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c")
    _, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, 1.0))
    with pytest.raises(ValueError, match="micro_batch_size=3 must divide the batch's 16 rows"):
        r._guidance(7, batch, batch.guidance, 3)
    steps, _, _ = r._guidance(7, batch, batch.guidance, 4)
    adv = torch.zeros(16)
    with pytest.raises(ValueError, match=r"the 3 micro-batches' guidance covers \[4, 4, 4\] rows: they must split "
                                         r"the batch's 16 rows evenly"):
        r.train_pass(batch, adv, steps[:3])
    with pytest.raises(ValueError, match="every micro-batch's StepGuidance needs its token_mask"):
        r.train_pass(batch, adv, [dataclasses.replace(s, token_mask=None) if i == 2 else s for i, s in
                                  enumerate(steps)])
    with pytest.raises(ValueError, match=r"micro_batch_size=-1 must be 0 \(the whole batch in one micro-batch\)"):
        RLConfig(micro_batch_size=-1)
    with pytest.raises(ValueError, match="micro_batch_size=0 must be >= 1 and divide the batch's 16 rows"):
        r.policy.forward_backward(batch.tokens, 0, lambda i, lp, sl: lp.sum())


class _CreditTask(AdditionTask):
    """The driver's addition task with a test-chosen reward: ``by_prompt`` maps a prompt to its reward (the same for
    every response: a group that carries no signal), else partial credit, the share of the answer's characters that
    are right (responses of one prompt differ: a signal at step 0 already, unlike the exact-answer reward)."""

    def __init__(self):
        super().__init__(3)
        self.by_prompt: dict[str, float] | None = None

    def reward(self, p, response):
        if self.by_prompt is not None:
            return self.by_prompt[p.prompt]
        return sum(a == b for a, b in zip(response, p.answer)) / len(p.answer)


def _credit_run(ckpt, tmp_path, lr=5e-5):
    cfg = dataclasses.replace(RL, steps=1, sentinel_prompts=0, lr=lr)
    task = _CreditTask()
    return GRPORun(make_arm("bf16", TraceConfig()), cfg, task, ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c"), task


def test_groups_whose_rewards_are_equal_carry_no_gradient(megatron_cpu, ckpt, tmp_path):
    """Advantages are normalised within each prompt's group: a batch where one prompt's responses all earn 1 and
    every other prompt's all earn 0 has advantage 0 everywhere, so the step's loss and gradient are exactly 0 (over
    the whole batch the rewards differ: normalising there instead would train toward the first prompt)."""
    r, task = _credit_run(ckpt, tmp_path)
    problems, _ = r._prompts(0)
    first = problems[0].prompt
    task.by_prompt = {p.prompt: float(p.prompt == first) for p in problems}
    assert 0 < sum(task.by_prompt[p.prompt] for p in problems) < len(problems)  # the batch's rewards differ
    m = r.step()
    assert m["reward"] == RL.group_size / len(problems)
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0, m


def _z_scores(rewards: list[float], g: int) -> list[float]:
    """Each reward's z-score within its group of ``g`` (independently of ``group_advantages``)."""
    adv = []
    for k in range(0, len(rewards), g):
        grp = rewards[k:k + g]
        mean = sum(grp) / g
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / g)
        adv += [0.0 if std == 0 else (x - mean) / (std + 1e-6) for x in grp]
    return adv


def test_a_step_raises_the_advantage_weighted_likelihood_of_its_responses(megatron_cpu, ckpt, tmp_path):
    """The policy-gradient direction through ``step()``: with partial credit the responses of one prompt earn
    different rewards, and one small step raises sum_i A_i log pi(response_i), A_i the reward's z-score within the
    prompt's group (computed here independently of ``group_advantages``)."""
    r, task = _credit_run(ckpt, tmp_path, lr=1e-5)
    problems, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, r.cfg.temperature))  # what step 0 samples (seeded by step)
    rewards = [task.reward(p, r.tok.decode(x, strict=True)) for p, x in zip(problems, batch.responses())]
    adv = _z_scores(rewards, RL.group_size)
    assert any(adv), rewards  # a signal at step 0

    def objective() -> float:
        with torch.no_grad():
            lp = r.policy.logprobs(batch.tokens, r.cfg.temperature)
        per_seq = torch.where(batch.response_mask, lp, 0.0).sum(1).double()
        return float((torch.tensor(adv, dtype=torch.float64) * per_seq).sum())

    before = objective()
    m = r.step()
    assert m["reward"] == sum(rewards) / len(rewards) and m["grad_norm"] > 0
    after = objective()
    assert after > before, (before, after)


def test_a_steps_metrics_are_over_its_response_tokens_and_name_the_served_version(megatron_cpu, ckpt, tmp_path):
    """The step's row recomputed independently from the batch it trains on: the reward is the mean over all rows, the
    loss is -sum(A * min(exp(lp - lp_rollout), cap)) over the response tokens (ratio 1 before the update), the
    mismatch is over the same tokens, and policy_version is the version the rollout serves after the sync."""
    r, task = _credit_run(ckpt, tmp_path)
    g = RL.group_size
    for step in range(2):
        problems, ids = r._prompts(step)
        batch = r.rollout.generate(ids, r._sampling(step, r.cfg.temperature))
        with torch.no_grad():
            lp = r.policy.logprobs(batch.tokens, r.cfg.temperature).double()
        rewards = [task.reward(p, r.tok.decode(x, strict=True)) for p, x in zip(problems, batch.responses())]
        adv = _z_scores(rewards, g)
        assert any(adv), rewards
        sel = batch.response_mask
        # (policy.logprobs is not the training forward bit for bit: the mismatch is checked to its order only)
        d = (lp - batch.logprobs.double())[sel]
        w = torch.exp(d).clamp(max=r.cfg.tis_cap)
        a = torch.tensor(adv, dtype=torch.float64)[:, None].expand(sel.shape)[sel]
        m = r.step()
        assert m["reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert m["loss"] == pytest.approx(float(-(a * w).sum() / sel.sum()), abs=1e-4)  # (sums to ~0)
        assert m["mismatch/logprob_abs_diff_token_mean"] == pytest.approx(float(d.abs().mean()), rel=0.5)
        assert m["rl/ratio_mean"] == pytest.approx(1.0) and m["rl/clip_frac"] == 0.0
        assert m["policy_version"] == step + 1 == r.rollout.policy_version == r.state.version


def test_the_rollouts_records_given_directly_guide_as_the_cache_does(megatron_cpu, ckpt, tmp_path):
    """README: ``StepGuidance(sites=batch.guidance, routing=batch.routing, token_mask=batch.attention_mask)`` straight
    from ``generate`` (no cache, the colocated loop) guides the trainer as the shipped path does (records packed, put in
    the ``GuidanceCache`` and assembled): every guided row used, the same log-probs and trainer codes bit for bit, and
    those codes at the guided sites (nearly) the rollout's own (its full records)."""
    from megatron_trace.megatron import StepGuidance, trace_guidance
    from megatron_trace.metrics import quant_counts

    r = GRPORun(make_arm("trace", TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    _, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, 1.0))
    keep = keep_for_arm(batch.guidance, r.arm, MODEL.num_layers)
    assert keep and all(sg.compact for sg in keep.values())  # the arm's compact records of its guided layers
    direct = StepGuidance(sites=keep, routing=batch.routing, token_mask=batch.attention_mask)
    (shipped,), counter, _ = r._guidance(1, batch, batch.guidance)
    runs = []
    for sg in (direct, shipped):
        with torch.no_grad(), trace_guidance(r.policy.model, sg, record=True, compact=False) as h:
            runs.append((r.policy.logprobs(batch.tokens), h.recorded().sites, h.coverage(), h.counter.used))
    (lp_direct, rec_direct, cov, used), (lp_cache, rec_cache, _, _) = runs
    assert counter.as_dict("a")["a/coverage"] == 1.0 and cov == 1.0 and used > 0
    assert torch.equal(lp_direct, lp_cache)
    assert rec_direct.keys() == rec_cache.keys() >= keep.keys()
    for key in keep:
        a, b, full = rec_direct[key], rec_cache[key], batch.guidance[key]
        assert torch.equal(a.record.codes, b.record.codes) and torch.equal(a.valid, b.valid), key
        c = quant_counts(a.record, full.record, rows=full.valid & a.valid)
        assert c.elements > 0 and c.mismatched <= 0.01 * c.elements, (key, c)


@pytest.mark.parametrize("kv", [("kv_k",), ("kv_v",), ("kv_k", "kv_v")], ids=["k", "v", "kv"])
def test_an_fp4_kv_cache_splits_the_mismatch_by_phase_whichever_of_k_v_it_holds(megatron_cpu, ckpt, tmp_path, kv):
    """README: the mismatch is split into prefill and decode positions when the KV cache is FP4. An FP4 cache of V
    alone (``sites=("kv_v",)``, accepted) logged no split: the driver asked whether K was quantized. The split counts
    each response's first token as prefill, the rest as decode, and its token-weighted mean is the step's."""
    rl = RLConfig(steps=1, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("fp4_qat", TraceConfig(sites=kv, guided_sites=kv)), rl, get_task("add"), ckpt,
                out_dir=tmp_path, cache_dir=tmp_path / "c")
    _, ids = r._prompts(0)
    mask = r.rollout.generate(ids, r._sampling(0, r.cfg.temperature)).response_mask  # what step 0 samples
    m = r.step()
    n, rows = int(mask.sum()), mask.shape[0]
    assert (m["mismatch/prefill/tokens"], m["mismatch/decode/tokens"]) == (rows, n - rows)
    split = sum(m[f"mismatch/{p}/tokens"] * m[f"mismatch/{p}/logprob_abs_diff_token_mean"]
                for p in ("prefill", "decode")) / n
    assert split == pytest.approx(m["mismatch/logprob_abs_diff_token_mean"], rel=1e-9)
    assert m["mismatch/first_token_abs_diff"] == pytest.approx(m["mismatch/prefill/logprob_abs_diff_token_mean"])


@pytest.mark.parametrize("seed", [0, 7, 2**50, 2**62], ids=["0", "7", "2^50", "2^62"])
def test_a_steps_prompts_and_sampling_seeds_take_any_seed(seed):
    """RLConfig takes any int seed >= 0, but seed * 100003 + step overflowed torch's generator at the first step (after
    the whole setup) from seed 2**50 ('Overflow when unpacking long long'). A step's seeds stay in [0, 2**63) (the same
    as before for small seeds), the same step reproduces its prompts, and the next step draws other ones."""
    from types import SimpleNamespace

    from megatron_trace.rl.tasks import CharTokenizer

    run_ = SimpleNamespace(cfg=RLConfig(seed=seed, prompts_per_step=4, group_size=3), task=get_task("add"),
                           tok=CharTokenizer())
    problems, ids = GRPORun._prompts(run_, 5)
    assert len(ids) == 12 and all(problems[i] == problems[i - i % 3] for i in range(12))  # groups contiguous
    assert GRPORun._prompts(run_, 5) == (problems, ids) and GRPORun._prompts(run_, 6)[0] != problems
    sampling = GRPORun._sampling(run_, 5, 1.0)
    assert 0 <= sampling.seed < 2**63 and sampling.seed != GRPORun._sampling(run_, 6, 1.0).seed
    if seed < 2**40:
        assert sampling.seed == seed * 7919 + 5
