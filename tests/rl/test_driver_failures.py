"""A GRPO step that raises after its optimizer step: the step counts, so its retry serves its weights first and never
trains the same prompts twice (the driver's other failure paths: tests/rl/test_driver.py)."""

import pytest

from megatron_trace.config import TraceConfig
from megatron_trace.monitor import MismatchGateError, TrendAlarm
from megatron_trace.rl.arms import make_arm
from megatron_trace.rl.driver import GRPORun, RLConfig
from megatron_trace.rl.tasks import get_task

from . import test_driver

megatron_cpu, ckpt = test_driver.megatron_cpu, test_driver.ckpt  # (its fixtures: Megatron on CPU, the SFT model)


def test_a_step_whose_metrics_raise_after_the_optimizer_step_counts_and_is_not_trained_again(megatron_cpu, ckpt,
                                                                                              tmp_path):
    """The step counter moved after the step's metrics: a trend alarm raising (``raise_on_alarm``; or an interrupt)
    there left step 1's update in the weights but the step uncounted (state step 1, version 1, its records held in the
    cache), so the next step() trained step 1's prompts again on the stepped weights."""
    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig()), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    # fires once its window of 2 steps is full (a constant metric's slope 0 is above -1): at step 1
    r.trend = TrendAlarm(window=2, mode="absolute", max_slope=-1.0, key="trainer/micro_batches", raise_on_alarm=True)
    r.step()
    with pytest.raises(MismatchGateError, match="trainer/micro_batches rises"):
        r.step()
    assert (r.state.step, r.state.version, r.rollout.policy_version, r.cache.steps) == (2, 2, 1, [])
    r.trend = TrendAlarm(window=2)
    m = r.step()  # the sync to version 2 first, then step 2's prompts on version 2's weights
    assert m["guidance/assembly/coverage"] == 1.0 and m.get("guidance/assembly/fallback/version", 0.0) == 0.0
    assert (r.state.step, r.state.version, r.rollout.policy_version) == (3, 3, 3)


def _weights(r) -> dict:
    return {k: v.clone() for k, v in r.policy.model.state_dict().items() if v is not None}


def test_a_checkpoint_refused_half_way_leaves_the_run_as_it_was(megatron_cpu, ckpt, tmp_path):
    """The weights were loaded before the step state was read: a checkpoint whose state has a field this version does
    not know raised there, leaving the checkpoint's weights under this run's step and version (the rollout's records
    of its own, other weights then matched the trainer's version)."""
    import torch

    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig()), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    r.step()
    r.save(tmp_path / "ck.pt")
    r.step()
    ck = torch.load(tmp_path / "ck.pt", weights_only=False)
    ck["state"]["a_later_field"] = 1
    for v in ck["policy"]["model"].values():  # (weights other than the run's for sure: a step may change none)
        if v is not None and v.is_floating_point():
            v += 1
    torch.save(ck, tmp_path / "newer.pt")
    before, state = _weights(r), (r.state.step, r.state.version)
    with pytest.raises(TypeError, match="a_later_field"):
        r.load(tmp_path / "newer.pt")
    after = _weights(r)
    assert (r.state.step, r.state.version) == state == (2, 2)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_resume_whose_sync_raised_is_synced_by_the_next_step(megatron_cpu, ckpt, tmp_path):
    """The resume's reset sync raising left no sync pending: the next step() rolled out on the rollout's later weights
    (version 2; the trainer back at 1: every record rejected) and its own sync to version 2 was refused as not newer."""
    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig()), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    r.step()
    r.save(tmp_path / "ck.pt")
    r.step()

    def dies(*args, **kwargs):  # the transport to the rollout fails (as tests/rl/test_driver.py's failed sync)
        raise RuntimeError("the transport died")

    r.rollout.update_weights = dies
    with pytest.raises(RuntimeError, match="the transport died"):
        r.load(tmp_path / "ck.pt")
    assert (r.state.step, r.state.version, r.rollout.policy_version) == (1, 1, 2)
    del r.rollout.update_weights
    m = r.step()  # the resume's sync (back to version 1) first, then step 1's prompts on version 1's weights
    assert m["guidance/assembly/coverage"] == 1.0 and m.get("guidance/assembly/fallback/version", 0.0) == 0.0
    assert (r.state.step, r.state.version, r.rollout.policy_version) == (2, 2, 2)


def test_a_resume_whose_cache_cannot_be_emptied_is_synced_by_the_next_step(megatron_cpu, ckpt, tmp_path):
    """load set the checkpoint's weights and step state, then invalidated the cached steps before its reset sync: a
    spilled shard it could not delete raised there with no sync pending (the next step() rolled out on the rollout's
    later weights, every record rejected, and its own sync refused as not newer), and the steps after it stayed held.
    """
    from megatron_trace.guidance import split_batch

    from ..guidance._data import make_batch

    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    d = tmp_path / "c"
    r = GRPORun(make_arm("trace", TraceConfig(cache_budget_mb=0)), rl, get_task("add"), ckpt, out_dir=tmp_path,
                cache_dir=d)  # (budget 0: every put spills)
    r.step()
    r.save(tmp_path / "ck.pt")
    r.step()
    batch, _, tok, mask = make_batch(B=2)
    for step in (7, 8):  # steps left held (as by steps that raised before training), one shard each
        r.cache.put(step, split_batch(batch, tok, version=0, attention_mask=mask))
    shard = next(d.glob("guidance_step00000007_*.safetensors"))
    shard.unlink()
    shard.mkdir()  # (an entry that unlink refuses: root ignores a read-only directory)
    (shard / "x").touch()
    with pytest.raises(OSError, match=rf"guidance step 7 was dropped, but .*{shard.name}"):
        r.load(tmp_path / "ck.pt")
    assert (r.state.step, r.state.version, r.rollout.policy_version, r.cache.steps) == (1, 1, 2, [])
    assert not list(d.glob("guidance_step00000008_*"))
    m = r.step()  # the resume's sync (back to version 1) first, then step 1's prompts on version 1's weights
    assert m["guidance/assembly/coverage"] == 1.0 and m.get("guidance/assembly/fallback/version", 0.0) == 0.0
    assert (r.state.step, r.state.version, r.rollout.policy_version) == (2, 2, 2)


def _split_groups(opt: dict) -> None:
    """Another optimizer's AdamW: its parameters in two groups (torch refuses the group count on load)."""
    g = opt["param_groups"][0]
    opt["param_groups"] = [dict(g, params=g["params"][:1]), dict(g, params=g["params"][1:])]


def _transposed_moment(opt: dict) -> None:
    """A moment of another shape than its master weight (torch loads it as it is; the next step fails on it)."""
    i, st = next((i, st) for i, st in opt["state"].items() if st["exp_avg"].dim() == 2
                 and st["exp_avg"].shape[0] != st["exp_avg"].shape[1])
    st["exp_avg"] = st["exp_avg"].t().contiguous()


@pytest.mark.parametrize("damage, match", [
    (_split_groups, r"AdamW has 2 parameter group\(s\) of \[1, \d+\] parameters, this optimizer 1 of \[\d+\]"),
    (_transposed_moment, r"AdamW 'exp_avg' of master weight #\d+ is \(\d+, \d+\), its master \(\d+, \d+\)"),
], ids=["groups", "moment_shape"])
def test_a_checkpoint_whose_optimizer_state_is_refused_leaves_the_model_unloaded(megatron_cpu, ckpt, tmp_path, damage,
                                                                                 match):
    """``MegatronPolicy.load_state_dict`` loaded the model, then the optimizer: AdamW's own load refusing the state (a
    group count) left the checkpoint's weights in the model beside this run's optimizer; a moment of another shape
    loaded silently and failed the next step. The optimizer state is checked, all of it, before anything is set."""
    import torch

    rl = RLConfig(steps=3, prompts_per_step=2, group_size=2, eval_problems=4, sentinel_prompts=0)
    r = GRPORun(make_arm("trace", TraceConfig()), rl, get_task("add"), ckpt, out_dir=tmp_path, cache_dir=tmp_path / "c")
    r.step()
    r.save(tmp_path / "ck.pt")
    ck = torch.load(tmp_path / "ck.pt", weights_only=False)
    damage(ck["policy"]["optimizer"]["opt"])
    for v in ck["policy"]["model"].values():  # (weights other than the run's for sure)
        if v is not None and v.is_floating_point():
            v += 1
    torch.save(ck, tmp_path / "bad.pt")
    before = _weights(r)
    masters = [m.clone() for m in r.policy.optimizer.master]
    with pytest.raises(ValueError, match=rf"checkpoint .*bad\.pt: the optimizer state's {match}; nothing loaded"):
        r.load(tmp_path / "bad.pt")
    after = _weights(r)
    assert all(torch.equal(after[k], v) for k, v in before.items()) and r.state.step == 1
    assert all(torch.equal(m, s) for m, s in zip(r.policy.optimizer.master, masters))


def test_a_master_adamw_state_whose_adamw_part_is_refused_leaves_the_masters_unloaded():
    """The masters were copied before AdamW's own load refused the state (another group count): the optimizer was
    left with the state's masters and its own moments."""
    import torch

    from megatron_trace.rl.trainer import MasterAdamW

    params = [torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(3))]
    opt = MasterAdamW(params, lr=1e-3)
    other = MasterAdamW([torch.nn.Parameter(torch.full(p.shape, 7.0)) for p in params], lr=1e-3)
    sd = other.state_dict()
    g = sd["opt"]["param_groups"][0]
    sd["opt"]["param_groups"] = [dict(g, params=g["params"][:1]), dict(g, params=g["params"][1:])]
    with pytest.raises(ValueError, match=r"AdamW has 2 parameter group\(s\) of \[1, 1\] parameters, this optimizer 1 "
                                         r"of \[2\]; nothing loaded"):
        opt.load_state_dict(sd)
    assert all(torch.equal(m, torch.ones_like(m)) for m in opt.master)
    del sd["opt"]
    with pytest.raises(ValueError, match=r"the optimizer state lacks \['opt'\]"):
        opt.load_state_dict(sd)
    opt.release()
    other.release()


def test_a_master_adamw_state_of_other_master_shapes_is_refused_before_anything_is_set():
    """As many masters as this optimizer's, one of another shape: ``copy_`` broadcast a [4] into a [4, 4] (or failed
    after the masters before it were set); refused naming the first that differs, nothing set."""
    import torch

    from megatron_trace.rl.trainer import MasterAdamW

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4, 4))]
    opt = MasterAdamW(params, lr=1e-3)
    other = MasterAdamW([torch.nn.Parameter(torch.full((3,), 7.0)), torch.nn.Parameter(torch.full((4,), 7.0))],
                        lr=1e-3)
    with pytest.raises(ValueError, match=r"has 2 master weights, this optimizer 2; the first that differs is #1 "
                                         r"\(state \(4,\), optimizer \(4, 4\)\): a state of other parameters"):
        opt.load_state_dict(other.state_dict())
    assert all(torch.equal(m, torch.ones_like(m)) for m in opt.master)
    same = MasterAdamW([torch.nn.Parameter(torch.full(p.shape, 7.0)) for p in params], lr=1e-3)
    sd = same.state_dict()  # one group, of fewer parameters than masters: AdamW refused it after the masters were set
    sd["opt"]["param_groups"][0]["params"] = sd["opt"]["param_groups"][0]["params"][:1]
    with pytest.raises(ValueError, match=r"AdamW has 1 parameter group\(s\) of \[1\] parameters, this optimizer 1 "
                                         r"of \[2\]; nothing loaded"):
        opt.load_state_dict(sd)
    assert all(torch.equal(m, torch.ones_like(m)) for m in opt.master)
    for o in (opt, other, same):
        o.release()
