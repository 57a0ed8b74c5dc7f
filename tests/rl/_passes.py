"""The RL driver's trainer pass over Megatron's schedule, one micro-batch against several: shared by the CPU test
(tests/rl/test_driver.py) and the GPU test (tests/gpu/test_rl_driver_gpu.py)."""

from __future__ import annotations

import torch


def train_pass(r, batch, mbs: int, shift: int = 0):
    """``GRPORun.train_pass`` over micro-batches of ``mbs`` rows: (log-probs, fp32 gradients summed over the
    micro-batches, each micro-batch's recorded codes, row stats). ``shift``: micro-batch i gets micro-batch
    (i + shift)'s routing (wrong on purpose; a stock model)."""
    steps, _, _ = r._guidance(100 + mbs, batch, batch.guidance, mbs)
    steps = steps[shift:] + steps[:shift]  # (a stock model reads only each micro-batch's routing)
    adv = torch.linspace(-1, 1, batch.tokens.shape[0], device=batch.tokens.device)
    logp, h = r.train_pass(batch, adv, steps, record=r.arm.trainer_fp4)
    opt, names = r.policy.optimizer, {id(p): k for k, p in r.policy.model.named_parameters()}
    grads = {names[id(p)]: m.grad.clone() for p, m in zip(opt.params, opt.master) if m.grad is not None}
    recorded = [h.microbatch(i).recorded() for i in range(len(steps))] if r.arm.trainer_fp4 else []
    r.cache.drop(100 + mbs)
    return logp, grads, recorded, (h.stats() if r.arm.trainer_fp4 else {})


def check_micro_batches_match_one(r, *, logp_atol: float = 1e-5, grad_rel: float = 2**-7) -> dict:
    """The trainer pass over 4 micro-batches of Megatron's schedule (each with its own routing and assembled
    guidance) computes the one-micro-batch pass's log-probs (within ``logp_atol``) and gradients (within
    ``grad_rel`` of each tensor's norm: each backward's bf16 gradient is rounded once, 2^-9 relative, and the
    micro-batches' are summed in fp32), counts the same rows, and the trainer's codes at every guided site are the
    rollout's (its own micro-batch's). Returns what it measured."""
    _, ids = r._prompts(0)
    batch = r.rollout.generate(ids, r._sampling(0, 1.0))
    b = batch.tokens.shape[0]
    lp1, g1, rec1, st1 = train_pass(r, batch, b)
    lp4, g4, rec4, st4 = train_pass(r, batch, b // 4)
    sel = batch.response_mask
    seen = {"logp_max_abs_diff": float((lp4[sel] - lp1[sel]).abs().max())}
    assert seen["logp_max_abs_diff"] <= logp_atol, seen
    assert g4.keys() == g1.keys()
    rel = {k: float((g4[k].float() - g1[k].float()).norm() / g1[k].float().norm().clamp_min(1e-30)) for k in g1}
    seen["grad_max_rel_diff"] = max(rel.values())
    assert seen["grad_max_rel_diff"] <= grad_rel, sorted(rel.items(), key=lambda kv: -kv[1])[:3]
    assert st4 == st1  # every row counted once, with the same outcome
    if r.arm.trainer_fp4:
        m = r._quant_metrics(rec4, batch.guidance, b // 4)
        assert m["quant/guided/code_mismatch_rate"] == 0.0 and m["quant/guided/scale_mismatch_rate"] == 0.0
        assert _nan_free(m) == _nan_free(r._quant_metrics(rec1, batch.guidance, b))
        # the micro-batches' guidance is their own: micro-batch 1's records in 0's place would not match
        swapped = r._quant_metrics([rec4[1], rec4[0], *rec4[2:]], batch.guidance, b // 4)
        assert swapped["quant/guided/code_mismatch_rate"] > 0.1
    else:  # each micro-batch replays its own routing: another's changes the log-probs
        lp_wrong, *_ = train_pass(r, batch, b // 4, shift=1)
        seen["wrong_routing_logp_max_abs_diff"] = float((lp_wrong[sel] - lp1[sel]).abs().max())
        # (moves them 10x more than micro-batching does)
        assert seen["wrong_routing_logp_max_abs_diff"] > max(10 * seen["logp_max_abs_diff"], 1e-3), seen
    return seen


def _nan_free(d: dict) -> dict:
    return {k: "nan" if v != v else v for k, v in d.items()}
