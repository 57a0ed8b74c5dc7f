import math
import re

import pytest
import torch

from megatron_trace.rl.grpo import group_advantages, policy_loss
from megatron_trace.rl.tasks import AdditionTask, CharTokenizer, get_task, response_rewards, sft_batch
from megatron_trace.rl.trainer import batch_slices, token_logprobs
from megatron_trace.rollout.base import SamplingParams


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    ids = tok.encode("042+917=", bos=True)
    assert ids[0] == tok.bos_id and tok.decode(ids) == "042+917="
    assert tok.decode(tok.encode("0959", eos=True) + [5, 6]) == "0959"  # stops at EOS
    with pytest.raises(ValueError, match=r"\['a'\] are not in the vocabulary"):
        tok.encode("1a")


def test_a_response_holding_a_sampled_special_token_is_wrong():
    """The rollout samples from the whole vocabulary: "<bos>0532" (no EOS within max_new_tokens) or "0532<pad>"
    decoded to the answer "0532" and got reward 1."""
    from types import SimpleNamespace

    from megatron_trace.rl.driver import GRPORun

    tok, task = CharTokenizer(), get_task("add")
    p = task.sample(torch.Generator().manual_seed(0))
    ans = tok.encode(p.answer)
    responses = [ans + [tok.eos_id], [tok.bos_id] + ans, ans + [tok.pad_id], ans[:2] + [tok.bos_id] + ans[2:]]
    assert tok.decode(responses[1]) == tok.decode(responses[2]) == p.answer  # the lax decode drops them
    assert tok.decode(responses[1], strict=True) == "<bos>" + p.answer
    run, batch = SimpleNamespace(task=task, tok=tok), SimpleNamespace(responses=lambda: responses)
    assert GRPORun._rewards(run, [p] * 4, batch) == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ["add", "add5", "reverse"])
def test_tasks_answers_and_rewards(name):
    task, g = get_task(name), torch.Generator().manual_seed(0)
    assert task.name == name
    for _ in range(50):
        p = task.sample(g)
        assert len(p.answer) == task.answer_len
        assert task.reward(p, p.answer) == 1.0 and task.reward(p, p.answer[:-1]) == 0.0
        if name.startswith("add"):
            a, b = p.prompt[:-1].split("+")
            assert len(a) == len(b) == task.answer_len - 1 and int(p.answer) == int(a) + int(b)
            noisy = task.noisy_answer(p, g)  # the carry-dropping noisy label of the SFT set
            assert len(noisy) == task.answer_len and noisy[1:] == "".join(
                str((int(x) + int(y)) % 10) for x, y in zip(a, b))
        else:
            assert p.answer == p.prompt[:-1][::-1]
    with pytest.raises(ValueError, match="task='mul'"):
        get_task("mul")


def test_noisy_sft_batch_shares_and_masks():
    tok, task, g = CharTokenizer(), get_task("add"), torch.Generator().manual_seed(1)
    ids, mask = sft_batch(task, tok, 400, g, noise=0.6)
    assert ids.shape == (400, 1 + 8 + 4 + 1) and mask.sum(1).eq(5).all()
    wrong = sum(tok.decode(r[9:]) != f"{int(tok.decode(r[1:4])) + int(tok.decode(r[5:8])):04d}" for r in ids)
    assert 0.4 < wrong / 400 < 0.7  # 60% noisy labels, minus those where no carry happens


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4)
    assert torch.allclose(a[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(a[4:], torch.zeros(4))
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        group_advantages(r, 3)


@pytest.mark.parametrize("group_size", [0, -1, 1.5, True, None], ids=["zero", "negative", "float", "bool", "none"])
def test_group_advantages_name_a_bad_group_size(group_size):
    """group_size=0 was a bare ZeroDivisionError ('integer modulo by zero'), -1 'only one dimension can be
    inferred', 1.5 a view() TypeError, True a group of one."""
    with pytest.raises(ValueError, match=re.escape(f"group_size={group_size!r} must be an int >= 1")):
        group_advantages(torch.tensor([1.0, 0.0]), group_size)


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf"), True])
def test_group_advantages_name_a_bad_eps(eps):
    """eps=-1e-6 under a group's std of 5e-7 flipped its advantages' signs (the worse response got +0.91), NaN made
    them NaN; eps=0 is the plain z-score (a constant group still 0)."""
    r = torch.tensor([1.0, 1.0 + 2**-20, 0.5, 0.5])
    with pytest.raises(ValueError, match=re.escape(f"eps={eps!r} must be a finite number >= 0")):
        group_advantages(r, 2, eps=eps)
    assert group_advantages(r, 2, eps=0).tolist() == [-1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_group_advantages_refuse_a_non_finite_reward(bad):
    """A NaN or infinite reward made its whole group's advantages NaN (and so the step's loss), without a word."""
    r = torch.tensor([1.0, 0.0, 0.0, bad])
    with pytest.raises(ValueError, match=r"rewards hold 1 NaN/Inf value\(s\), e.g. at \[3\]"):
        group_advantages(r, 2)


@pytest.mark.parametrize("rewards, group_size", [([], 4), ([0.5], 1), ([1.0, 0.0], 1), ([0.3, 0.3, 0.3], 3)],
                         ids=["no-rewards", "one-reward", "groups-of-one", "one-equal-group"])
def test_group_advantages_at_edge_sizes(rewards, group_size):
    a = group_advantages(torch.tensor(rewards), group_size)
    assert a.shape == (len(rewards),) and torch.equal(a, torch.zeros(len(rewards)))


@pytest.mark.parametrize("value", [0.7, 7.3, 12.7, 100.3, -3.1, 1e-3])
@pytest.mark.parametrize("group_size", [3, 5, 8])
def test_group_advantages_of_a_constant_group_are_zero(value, group_size):
    # float32 mean(r) of equal rewards is not always r: the group must still carry no signal
    r = torch.cat([torch.full((group_size,), value), torch.arange(group_size, dtype=torch.float32) * value])
    a = group_advantages(r, group_size)
    assert a.dtype == torch.float32
    assert torch.equal(a[:group_size], torch.zeros(group_size))
    assert abs(float(a[group_size:].double().mean())) < 1e-6
    std = float(r[group_size:].double().std(unbiased=False))
    assert float(a[group_size:].double().std(unbiased=False)) == pytest.approx(std / (std + 1e-6), abs=1e-6)


@pytest.mark.parametrize("big", [1e200, 1.5e308, 3e38], ids=["1e200", "near-float64-max", "near-float32-max"])
def test_group_advantages_of_huge_rewards_are_not_zero(big):
    """float64 rewards beyond ~1e154 overflowed the std's squares (inf): a group of rewards (big, -big) got advantages
    (0, 0), no signal, without a word; by the definition they are (1, -1) (std = big, eps negligible). A group of
    ordinary rewards beside it keeps its own."""
    r = torch.tensor([big, -big, big / 2, big, 0.0, 1.0], dtype=torch.float64)
    a = group_advantages(r, 2)
    assert a.tolist() == [1.0, -1.0, -1.0, 1.0, pytest.approx(-1.0, abs=1e-5), pytest.approx(1.0, abs=1e-5)]


def test_policy_loss_ppo_clip_and_tis():
    logp_old = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = (logp_old + torch.tensor([[0.5, 0.0]])).requires_grad_()
    adv = torch.tensor([1.0])
    mask = torch.tensor([[True, True]])
    loss, stats = policy_loss(logp, logp_old, logp_old, adv, mask, clip_eps=0.2, tis_cap=None)
    # token 0: ratio e^0.5 > 1.2 -> clipped at 1.2 ; token 1: ratio 1
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert stats["rl/clip_frac"] == 0.5
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(-0.5)
    # TIS: rollout much less likely than the trainer -> weight capped at 5
    lr = logp_old - 3.0
    loss_tis, _ = policy_loss(logp_old.clone(), logp_old, lr, adv, mask, tis_cap=5.0)
    assert loss_tis.item() == pytest.approx(-5.0)



def reference_policy_loss(logp, old, roll, adv, mask, clip_eps, tis_cap, ref, kl_coef):
    """The loss and d loss / d logp by the definitions, token by token in float64: -w * min(r A, clip(r) A) + kl * k3,
    w = min(exp(old - roll), cap) and A constants, averaged over the mask's tokens; the surrogate's gradient is r A
    where the unclipped term is the min or the ratio lies inside the clip band, else 0; k3's is 1 - exp(ref - logp)."""
    loss, grad, n = 0.0, torch.zeros(logp.shape, dtype=torch.float64), max(int(mask.sum()), 1)
    for b, t in mask.nonzero().tolist():
        lp, o, a = float(logp[b, t]), float(old[b, t]), float(adv[b])
        r = math.exp(lp - o)
        w = 1.0 if tis_cap is None else min(math.exp(o - float(roll[b, t])), tis_cap)
        unclipped, clipped = r * a, min(max(r, 1 - clip_eps), 1 + clip_eps) * a
        loss -= w * min(unclipped, clipped)
        if unclipped <= clipped or 1 - clip_eps <= r <= 1 + clip_eps:
            grad[b, t] -= w * r * a
        if kl_coef:
            d = float(ref[b, t]) - lp
            loss += kl_coef * (math.exp(d) - d - 1)
            grad[b, t] += kl_coef * (1 - math.exp(d))
    return loss / n, grad / n


@pytest.mark.parametrize("clip_eps, tis_cap, kl_coef", [(0.2, 5.0, 0.0), (0.0, None, 0.0), (10.0, 1.0, 0.0),
                                                        (0.2, 1e6, 0.3), (0.2, None, 0.3)])
@pytest.mark.parametrize("pad", ["right", "left"])
@pytest.mark.parametrize("lengths", [[0, 1, 6, 3], [6, 6, 6, 6]], ids=["0-1-max-3", "all-max"])
def test_policy_loss_and_its_gradient_are_the_definitions(clip_eps, tis_cap, kl_coef, pad, lengths):
    """Off-policy ratios on both sides of the clip band, rollout log-probs above and below the trainer's (TIS weights
    below 1, at the cap), responses of length 0 / 1 / max padded left or right: loss and d loss / d logp equal the
    token-by-token definition. The rollout's log-probs and the advantages carry a gradient here (the trainer's logp
    passed as the rollout's): the TIS weight is a constant all the same (it cancelled the ratio: gradient 0)."""
    g = torch.Generator().manual_seed(sum(lengths) + (pad == "left"))
    base = -torch.rand(4, 6, generator=g) * 3 - 0.01
    logp = base.clone().requires_grad_()
    old = base + 0.3 * torch.randn(4, 6, generator=g)
    roll = logp + 0.6 * torch.randn(4, 6, generator=g)  # (a gradient through logp)
    adv = torch.randn(4, generator=g).requires_grad_()
    pos, n = torch.arange(6), torch.tensor(lengths)[:, None]
    mask = pos < n if pad == "right" else pos >= 6 - n
    ref = base - 0.2 * torch.rand(4, 6, generator=g)
    loss, _ = policy_loss(logp, old, roll, adv, mask, clip_eps=clip_eps, tis_cap=tis_cap, logp_ref=ref,
                          kl_coef=kl_coef)
    (grad,) = torch.autograd.grad(loss, logp)
    want, want_grad = reference_policy_loss(base, old, roll.detach(), adv.detach(), mask, clip_eps, tis_cap, ref,
                                            kl_coef)
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-7)


def test_policy_loss_clips_a_ratio_below_one_minus_eps():
    """The lower clip bound (1 - eps) by hand: a negative advantage with ratio e^-0.5 < 0.8 takes the clipped 0.8 (no
    gradient); a positive one keeps the unclipped ratio (gradient -r / 2). A clip at 1 + eps on both sides gave 1.2."""
    logp_old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    logp = (logp_old + torch.tensor([[-0.5, 0.0], [-0.5, 0.0]])).requires_grad_()
    mask = torch.ones(2, 2, dtype=torch.bool)
    r = math.exp(-0.5)
    for adv, want, grad0 in ((-1.0, (0.8 + 1.0) / 2, 0.0), (1.0, -(r + 1.0) / 2, -r / 2)):
        loss, stats = policy_loss(logp[:1], logp_old[:1], logp_old[:1], torch.tensor([adv]), mask[:1], clip_eps=0.2,
                                  tis_cap=None)
        assert loss.item() == pytest.approx(want) and stats["rl/clip_frac"] == 0.5
        (g,) = torch.autograd.grad(loss, logp)
        assert g[0, 0].item() == pytest.approx(grad0, abs=1e-7)


def test_token_logprobs_score_each_token_from_the_logits_before_it():
    """log_softmax(logits[b, t - 1] / T)[tokens[b, t]] at position t, 0 at t = 0 (the rollout's layout: position t
    holds token t's log-prob), written out by hand."""
    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    for temp in (1.0, 0.7):
        got = token_logprobs(logits, tokens, temp)
        for b in range(2):
            assert got[b, 0].item() == 0.0
            for t in range(1, 5):
                z = [v / temp for v in logits[b, t - 1].tolist()]
                want = z[tokens[b, t]] - math.log(sum(math.exp(v) for v in z))
                assert got[b, t].item() == pytest.approx(want, abs=1e-5)

@pytest.mark.parametrize("adv_shape,other", [((4, 1), None), ((4, 5), None), ((2,), None), ((4,), "logp_rollout")])
def test_policy_loss_refuses_shapes_that_would_broadcast(adv_shape, other):
    """advantages [B, 1] or per-token [B, T] broadcast against [B, T] into a [B, B, T] loss (its value was ~0 where
    the [B] advantages gave -6.8e-3): named instead."""
    logp, mask = torch.zeros(4, 5), torch.ones(4, 5, dtype=torch.bool)
    roll = torch.zeros(4, 1) if other == "logp_rollout" else logp
    with pytest.raises(ValueError, match=r"advantages \[B\] \(got " + re.escape(str(adv_shape)) if other is None
                       else r"'logp_rollout': \(4, 1\)"):
        policy_loss(logp, logp, roll, torch.ones(adv_shape), mask)


def test_policy_loss_ignores_what_lies_outside_the_mask():
    # an engine may return NaN / -inf log-probs at prompt or padding positions: they must not reach loss or grads
    g = torch.Generator().manual_seed(0)
    logp_old = -torch.rand(2, 6, generator=g) - 0.1
    lr = logp_old - 0.3 * torch.rand(2, 6, generator=g)
    mask = torch.tensor([[False, True, True, True, False, False], [False, False, True, True, True, True]])
    adv = torch.tensor([0.7, -1.2])
    bad_lr = lr.masked_fill(~mask, float("nan"))
    bad_lr[0, 0], bad_lr[1, 1] = float("-inf"), float("inf")
    bad_old = logp_old.masked_fill(~mask, float("-inf"))
    out = []
    for old, roll in ((logp_old, lr), (bad_old, bad_lr)):
        logp = (logp_old + 0.05).requires_grad_()
        loss, stats = policy_loss(logp, old, roll, adv, mask, tis_cap=5.0, logp_ref=logp_old, kl_coef=0.1)
        loss.backward()
        out.append((loss.detach(), logp.grad, stats))
    (l0, g0, s0), (l1, g1, s1) = out
    assert torch.isfinite(l1) and torch.equal(l0, l1)
    assert torch.equal(g0, g1) and torch.equal(g1[~mask], torch.zeros(int((~mask).sum())))
    assert s0 == s1


def test_policy_loss_shares_of_micro_batches_add_up_to_the_batch_loss():
    g = torch.Generator().manual_seed(3)
    logp, roll = -torch.rand(8, 6, generator=g), -torch.rand(8, 6, generator=g)
    mask = torch.rand(8, 6, generator=g) > 0.3
    adv = torch.randn(8, generator=g)
    whole, stats = policy_loss(logp, logp + 0.01, roll, adv, mask)
    n = int(mask.sum())
    parts = [policy_loss(logp[s], logp[s] + 0.01, roll[s], adv[s], mask[s], num_tokens=n) for s in (slice(0, 4),
                                                                                                     slice(4, 8))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole)
    for k, v in stats.items():
        assert abs(parts[0][1][k] + parts[1][1][k] - v) < 1e-6, k
    bare = policy_loss(logp[:4], logp[:4] + 0.01, roll[:4], adv[:4], mask[:4], num_tokens=n, stats=False)
    assert bare[1] == {} and torch.equal(bare[0], parts[0][0])  # the same loss, no host reads for stats
    with pytest.raises(ValueError, match="num_tokens=-1 must be >= 0"):
        policy_loss(logp, logp, roll, adv, mask, num_tokens=-1)


def test_policy_loss_tis_weights_below_one_are_kept_and_the_gradient_is_the_hand_one():
    """TIS is min(exp(old - rollout), cap): a rollout likelier than the trainer gives a weight below 1, taken as is
    (no floor), and the weight and logp_old are constants: with logp_old = logp (the on-policy step, the driver's
    call) d loss / d logp is -adv * w / n per masked token, 0 elsewhere."""
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.125], [0.5, 0.5, 0.5]])).requires_grad_()
    roll = logp.detach() + torch.tensor([[3.0, 0.5, -4.0], [0.0, 0.0, 0.0]])
    adv, mask = torch.tensor([2.0, -1.0]), torch.tensor([[True, True, True], [True, False, False]])
    loss, stats = policy_loss(logp, logp, roll, adv, mask, clip_eps=0.2, tis_cap=5.0)
    w = torch.tensor([[math.exp(-3.0), math.exp(-0.5), 5.0], [1.0, 0.0, 0.0]])
    want = -(adv[:, None] * w).double().sum() / 4
    assert loss.item() == pytest.approx(float(want), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv[:, None] * w / 4)
    assert stats == {"rl/clip_frac": 0.0, "rl/ratio_mean": 1.0}


def test_policy_loss_stats_are_over_the_masked_tokens():
    """clip_frac and ratio_mean are shares of the response tokens (the mask's), not of every position."""
    old = torch.zeros(2, 4)
    logp = torch.tensor([[0.5, 0.0, 0.0, 0.0], [-0.5, 0.1, 0.0, 0.0]])  # ratios e^0.5, 1, 1, 1 / e^-0.5, e^0.1, ...
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    _, stats = policy_loss(logp, old, old, torch.ones(2), mask, clip_eps=0.2)
    assert stats["rl/clip_frac"] == pytest.approx(2 / 5)
    ratios = [math.exp(0.5), 1.0, math.exp(-0.5), math.exp(0.1), 1.0]
    assert stats["rl/ratio_mean"] == pytest.approx(sum(ratios) / 5, rel=1e-6)


def test_master_adamw_sums_the_backwards_gradients_in_fp32():
    """Two backward passes (two micro-batches) of a bf16 parameter: the master gradient is the fp32 sum of the two
    bf16 gradients, not their bf16 sum; the parameter holds no gradient of its own."""
    from megatron_trace.rl.trainer import MasterAdamW

    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([w], lr=1e-3)
    g1 = torch.tensor([1.0, 256.0, 1.0, 3.0], dtype=torch.bfloat16)
    g2 = torch.tensor([2**-8, 1.0, -1.0, 2**-9], dtype=torch.bfloat16)
    (w * g1).sum().backward()
    (w * g2).sum().backward()
    want = g1.float() + g2.float()
    assert w.grad is None and torch.equal(opt.master[0].grad, want)
    assert not torch.equal((g1 + g2).float(), want)  # the bf16 sum would round 1 + 2^-8 and 256 + 1
    opt.zero_grad()
    assert opt.master[0].grad is None
    (w * g1).sum().backward()
    assert torch.equal(opt.master[0].grad, g1.float())


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "unclipped"])
def test_a_master_adamw_step_without_gradients_changes_nothing(max_grad_norm):
    """No backward reached a parameter: the unclipped step's norm was torch.stack([]) ('stack expects a non-empty
    TensorList'); both give norm 0 and leave the weights as they were."""
    from megatron_trace.rl.trainer import MasterAdamW

    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([w], lr=0.1)
    assert opt.step(max_grad_norm) == 0.0 and torch.equal(w.detach(), torch.ones(4, dtype=torch.bfloat16))
    (w * 2).sum().backward()
    assert opt.step(max_grad_norm) == pytest.approx(4.0) and not torch.equal(w.detach(), torch.ones_like(w))


def test_a_master_adamw_clips_to_its_norm_and_refuses_a_norm_it_cannot_mean():
    """``max_grad_norm``: 0 or None is no clipping, a positive norm scales the gradient down to it (an independent
    computation: AdamW's first step moves each weight by lr * sign(grad), so the clip shows in a second one-step run
    through the norm it returns and the master gradient it leaves). A negative norm made clip_grad_norm_'s coefficient
    negative (every gradient's sign flipped, the step went uphill); NaN and bools are refused too."""
    from megatron_trace.rl.trainer import MasterAdamW

    for norm, kept in ((0, 5.0), (None, 5.0), (1.0, 1.0), (10.0, 5.0)):
        w = torch.nn.Parameter(torch.zeros(2))
        opt = MasterAdamW([w], lr=0.1)
        (w * torch.tensor([3.0, 4.0])).sum().backward()  # gradient (3, 4): norm 5
        assert opt.step(norm) == pytest.approx(5.0)
        assert float(torch.linalg.vector_norm(opt.master[0].grad)) == pytest.approx(kept, rel=1e-5)
        assert torch.all(w.detach() < 0)  # downhill
        opt.release()
    w = torch.nn.Parameter(torch.zeros(2))
    opt = MasterAdamW([w], lr=0.1)
    (w * torch.tensor([3.0, 4.0])).sum().backward()
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=rf"max_grad_norm={bad!r}: valid are None or 0"):
            opt.step(bad)
    assert torch.equal(w.detach(), torch.zeros(2))  # nothing stepped


def test_a_second_master_adamw_over_a_parameter_is_refused_until_the_first_is_released():
    """Two optimizers' gradient hooks on one parameter: the second would find the gradient already moved to the
    first's master copy (and freed). Building it is refused by name; after ``release`` it owns the parameter."""
    from megatron_trace.rl.trainer import MasterAdamW

    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    first = MasterAdamW([w], lr=1e-3)
    with pytest.raises(ValueError, match=r"1 parameters \(shapes \[\(4,\)\]...\) already have a MasterAdamW"):
        MasterAdamW([w], lr=1e-3)
    first.release()
    second = MasterAdamW([w], lr=1e-3)
    (w * 3).sum().backward()
    assert first.master[0].grad is None and torch.equal(second.master[0].grad, torch.full((4,), 3.0))


def test_a_dropped_model_and_its_master_adamw_are_freed():
    """Each gradient hook held the optimizer, and autograd keeps hooks where Python's cyclic GC cannot see them: a
    dropped model's MasterAdamW (its fp32 master copies and AdamW states) was never freed, one more per demo arm in
    the process. Now both go with the model, with a GC pass or without; training is as before."""
    import gc
    import weakref

    from megatron_trace.rl.trainer import MasterAdamW

    def trained():
        model = torch.nn.Linear(8, 8).to(torch.bfloat16)
        opt = MasterAdamW(model.parameters(), lr=1e-3)
        model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        assert opt.master[0].grad is not None and model.weight.grad is None
        opt.step()
        return weakref.ref(model), weakref.ref(opt), weakref.ref(opt.master[0]), weakref.ref(opt.opt)

    refs = trained()
    assert [r() is None for r in refs] == [True] * 4  # (reference counting alone)
    refs = trained()
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


@pytest.mark.parametrize("rows, mbs, want", [
    (4, None, [(0, 4)]), (4, 0, [(0, 4)]), (4, 1, [(i, i + 1) for i in range(4)]), (4, 4, [(0, 4)]),
    (1, 1, [(0, 1)]), (0, 2, []), (5, 2, [(0, 2), (2, 4), (4, 6)])],
                         ids=["none", "zero", "one-row-each", "one", "one-row", "no-rows", "short-last"])
def test_batch_slices_cover_every_row_once(rows, mbs, want):
    got = batch_slices(rows, mbs)
    assert [(s.start, s.stop) for s in got] == want
    assert sum(len(range(rows)[s]) for s in got) == rows


@pytest.mark.parametrize("mbs", [-1, 1.5, True], ids=["negative", "float", "bool"])
def test_batch_slices_name_a_bad_micro_batch_size(mbs):
    """A negative size gave no slice at all (every row dropped; the driver then divided by 0 micro-batches)."""
    with pytest.raises(ValueError, match=re.escape(f"micro_batch_size={mbs!r} must be None or an int >= 0")):
        batch_slices(4, mbs)


def test_policy_loss_refuses_a_kl_coef_without_the_reference_log_probs():
    """kl_coef > 0 without logp_ref dropped the KL term silently: the loss was the one of kl_coef=0."""
    g = torch.Generator().manual_seed(5)
    logp, old = -torch.rand(2, 4, generator=g), -torch.rand(2, 4, generator=g)
    adv, mask = torch.tensor([1.0, -0.5]), torch.ones(2, 4, dtype=torch.bool)
    ref = logp - 0.4
    base = policy_loss(logp, old, old, adv, mask)[0]
    with_kl = policy_loss(logp, old, old, adv, mask, kl_coef=0.5, logp_ref=ref)[0]
    d = (ref - logp).double()
    torch.testing.assert_close(with_kl.double(), base.double() + 0.5 * (d.exp() - d - 1).mean())  # k3, every token
    with pytest.raises(ValueError, match=r"kl_coef=0.5 needs logp_ref"):
        policy_loss(logp, old, old, adv, mask, kl_coef=0.5)


@pytest.mark.parametrize("name, bad", [
    ("clip_eps", -0.2), ("clip_eps", float("nan")), ("clip_eps", float("inf")), ("clip_eps", True),
    ("tis_cap", 0.0), ("tis_cap", -5.0), ("tis_cap", float("nan")), ("tis_cap", True),
    ("kl_coef", -0.1), ("kl_coef", float("nan")), ("kl_coef", float("inf")), ("kl_coef", True)])
def test_policy_loss_refuses_settings_it_cannot_mean(name, bad):
    """Each was a silent loss: clip_eps=-0.2 clamped every ratio to 0.8 (torch.clamp with min > max), tis_cap=0 made
    the loss 0 and -5 flipped its sign, kl_coef=-0.1 rewarded drifting from the reference, NaN gave a NaN loss and a
    bool counted as 0 / 1. The edges that mean something are kept: clip_eps 0, tis_cap inf (the IS weight uncapped)."""
    g = torch.Generator().manual_seed(6)
    logp, old = -torch.rand(2, 4, generator=g), -torch.rand(2, 4, generator=g)
    adv, mask, ref = torch.tensor([1.0, -0.5]), torch.ones(2, 4, dtype=torch.bool), logp - 0.3
    with pytest.raises(ValueError, match=re.escape(f"{name}={bad!r} must be")):
        policy_loss(logp, old, old - 1.0, adv, mask, logp_ref=ref, **{name: bad})
    inf_cap = policy_loss(logp, old, old - 1.0, adv, mask, clip_eps=0.0, tis_cap=math.inf)[0]
    torch.testing.assert_close(inf_cap, policy_loss(logp, old, old - 1.0, adv, mask, clip_eps=0.0, tis_cap=1e9)[0])


def test_noisy_labels_are_the_documented_wrong_answers():
    """add: the carry-dropping sum (its leading digit 0, as no carry leaves the last column); reverse: the answer with
    one adjacent pair swapped, every one of the 4 pairs in turn."""
    tok, g = CharTokenizer(), torch.Generator().manual_seed(3)
    add = get_task("add")
    for _ in range(20):
        p = add.sample(g)
        a, b = p.prompt[:3], p.prompt[4:7]
        assert add.noisy_answer(p, g) == "0" + "".join(str((int(x) + int(y)) % 10) for x, y in zip(a, b))
    rev, swapped = get_task("reverse"), set()
    for _ in range(200):
        p = rev.sample(g)
        noisy = rev.noisy_answer(p, g)
        i = next((k for k in range(4) if list(noisy) == [*p.answer[:k], p.answer[k + 1], p.answer[k],
                                                          *p.answer[k + 2:]]), None)
        assert i is not None, (p.answer, noisy)
        if noisy != p.answer:
            swapped.add(i)
    assert swapped == {0, 1, 2, 3}
    assert tok.decode(tok.encode(p.prompt)) == p.prompt


def test_the_reward_is_an_exact_match_and_operands_use_every_digit():
    g = torch.Generator().manual_seed(4)
    for name in ("add", "add5", "reverse"):
        task = get_task(name)
        p = task.sample(g)
        assert [task.reward(p, r) for r in (p.answer, p.answer + "0", p.answer[:-1], "")] == [1.0, 0.0, 0.0, 0.0]
    task = get_task("add")
    prompts = [task.sample(g).prompt for _ in range(100)]
    for pos in (0, 1, 2, 4, 5, 6):  # each digit of each operand takes every value 0-9
        assert {p[pos] for p in prompts} == set("0123456789"), pos


@pytest.mark.parametrize("problems, responses", [(3, 4), (4, 3), (0, 1)], ids=["fewer-problems", "fewer-responses",
                                                                          "no-problems"])
def test_rewards_need_one_problem_per_response(problems, responses):
    """zip dropped the extra ones: 3 problems for a group of 4 responses gave 3 rewards without a word."""
    tok, task = CharTokenizer(), get_task("add")
    p = task.sample(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=f"{problems} problems for {responses} responses"):
        response_rewards(task, tok, [p] * problems, [tok.encode(p.answer, eos=True)] * responses)


@pytest.mark.parametrize("bad", [-1, -16, 16, 99])
@pytest.mark.parametrize("strict", [True, False])
def test_decode_refuses_an_id_outside_the_vocabulary(bad, strict):
    """-1 decoded as ">" (Python's index from the end) and -16 as "<pad>"; 16 and up were a bare IndexError."""
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=re.escape(f"token id {bad} is outside the vocabulary [0, 16)")):
        tok.decode(tok.encode("0959") + [bad], strict=strict)


def test_a_reward_of_token_ids_instead_of_text_is_refused():
    """Token ids never equal the answer text: Task.reward(p, ids) was 0.0 for the right answer too (a run learning
    nothing, silently); the text's reward and response_rewards' (which decodes) are 1."""
    tok, task = CharTokenizer(), get_task("reverse")
    p = task.sample(torch.Generator().manual_seed(0))
    ids = tok.encode(p.answer, eos=True)
    with pytest.raises(TypeError, match=r"Task.reward takes the decoded response text, got list \["):
        task.reward(p, ids)
    assert task.reward(p, p.answer) == 1.0 and response_rewards(task, tok, [p], [ids]) == [1.0]


def test_token_logprobs_at_temperature_0_are_the_unscaled_ones():
    """T = 0 (greedy rollouts) scores as T = 1, the rollout's convention: no division by 0."""
    g = torch.Generator().manual_seed(1)
    logits, tokens = torch.randn(2, 4, 6, generator=g), torch.randint(0, 6, (2, 4), generator=g)
    got = token_logprobs(logits, tokens, 0.0)
    assert torch.isfinite(got).all() and torch.equal(got, token_logprobs(logits, tokens, 1.0))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), 1e-7, True])
def test_token_logprobs_refuse_a_temperature_the_rollout_refuses(bad):
    """The trainer scores at the rollout's temperature under SamplingParams' rule: -1 and NaN scored at T = 1 and inf
    gave every token log(1 / V), without a word."""
    logits, tokens = torch.randn(1, 3, 5), torch.tensor([[0, 1, 2]])
    with pytest.raises(ValueError, match=re.escape(f"temperature={bad!r} must be 0 (greedy) or a finite number >=")):
        token_logprobs(logits, tokens, bad)
    with pytest.raises(ValueError, match=re.escape(f"SamplingParams.temperature={bad!r} must be 0 (greedy)")):
        SamplingParams(temperature=bad)


def test_master_adamw_is_adamw_on_the_fp32_master_copies():
    """MasterAdamW's defaults are AdamW's (betas 0.9, 0.999) without weight decay; on fp32 parameters its steps are
    torch's AdamW over the same parameters, and the unclipped norm is the norm over all gradients together."""
    from megatron_trace.rl.trainer import MasterAdamW

    g = torch.Generator().manual_seed(2)
    w0, x = torch.randn(2, 3, generator=g), torch.randn(5, 3, generator=g)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    opt, want = MasterAdamW([ours, frozen], lr=0.05), torch.optim.AdamW([ref], lr=0.05, betas=(0.9, 0.999),
                                                                           weight_decay=0.0)
    assert opt.params == [ours]  # (a frozen parameter is left alone)
    for _ in range(3):
        for w in (ours, ref):
            ((x @ w.T) ** 2).sum().backward()
        norm = opt.step(None)
        assert norm == pytest.approx(float(ref.grad.norm()), rel=1e-6)
        want.step()
        ref.grad = None
        opt.zero_grad()
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = MasterAdamW([a, b], lr=0.1)
    (a * torch.tensor([3.0, 0.0]) + b * torch.tensor([0.0, 4.0])).sum().backward()
    assert opt.step(None) == pytest.approx(5.0)  # sqrt(3^2 + 4^2), not 3 + 4
    stale = torch.nn.Parameter(torch.zeros(2))
    (stale * 2).sum().backward()  # a gradient from before the optimizer: zero_grad drops it
    opt = MasterAdamW([stale], lr=0.1)
    opt.zero_grad()
    (stale * 3).sum().backward()
    assert torch.equal(opt.master[0].grad, torch.full((2,), 3.0))


def test_a_loaded_master_adamw_continues_with_the_checkpoints_fp32_masters():
    """The bf16 weights alone lose the fp32 master copies' low bits: ``load_state_dict`` restores the masters, so the
    steps after a resume are the ones the saved optimizer would have taken (a resumed step's own metrics come before
    its optimizer step: a run that dropped the masters reproduced them and diverged a step later)."""
    import copy

    from megatron_trace.rl.trainer import MasterAdamW

    def step(w, opt, k):
        (w * torch.tensor([1.0, -2.0, 3.0, k], dtype=torch.bfloat16)).sum().backward()
        opt.step(None)
        opt.zero_grad()

    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([w], lr=1e-3)
    step(w, opt, 1.0)
    sd = copy.deepcopy(opt.state_dict())
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = MasterAdamW([w2], lr=1e-3)
    opt2.load_state_dict(sd)
    assert not torch.equal(opt.master[0], w.detach().float())  # (the masters hold more than the bf16 weights)
    for k in (2.0, -1.0):
        step(w, opt, k), step(w2, opt2, k)
        assert torch.equal(opt2.master[0], opt.master[0]) and torch.equal(w2, w)


@pytest.mark.parametrize("ids,match", [
    ([3.9, 4.2], r"token id 3.9 \(float\) is not an int"),
    (torch.tensor([3.9, 2.5]), r"token id 3.9\d* \(float\) is not an int"),
    ([True, 3], r"token id True \(bool\) is not an int"),
    ("345", r"ids='345' must be token ids \(ints\), not text"),
])
def test_decode_refuses_ids_that_are_no_ints(ids, match):
    """int() took 3.9 as "0" (id 3), True as BOS and the text "345" as the ids 3, 4, 5 ("012"): a reward of another
    response, silently."""
    with pytest.raises(ValueError, match=match):
        CharTokenizer().decode(ids, strict=True)


def test_decode_takes_integer_tensors_and_numpy_ids():
    import numpy as np

    tok = CharTokenizer()
    ids = tok.encode("0959", eos=True)
    for given in (torch.tensor(ids), torch.tensor(ids, dtype=torch.int32), np.array(ids), [np.int64(i) for i in ids]):
        assert tok.decode(given) == "0959"


@pytest.mark.parametrize("call,match", [
    (lambda: AdditionTask(0), r"digits=0 must be an int >= 1"),
    (lambda: AdditionTask(2.0), r"digits=2.0 must be an int >= 1"),
    (lambda: AdditionTask(True), r"digits=True must be an int >= 1"),
    (lambda: sft_batch(get_task("add"), CharTokenizer(), 0, torch.Generator(), 0.1), r"n=0 must be an int >= 1"),
    (lambda: sft_batch(get_task("add"), CharTokenizer(), -3, torch.Generator(), 0.1), r"n=-3 must be an int >= 1"),
    (lambda: sft_batch(get_task("add"), CharTokenizer(), 2, torch.Generator(), math.nan), r"noise=nan must be a "
     r"number in \[0, 1\]"),
    (lambda: sft_batch(get_task("add"), CharTokenizer(), 2, torch.Generator(), 2.0), r"noise=2.0 must be"),
    (lambda: sft_batch(get_task("add"), CharTokenizer(), 2, torch.Generator(), "0.5"), r"noise='0.5' must be"),
])
def test_task_and_sft_batch_settings_are_checked_by_name(call, match):
    """An empty batch for n=0, no wrong label for noise=NaN and only wrong ones for 2; digits=0 failed deep in
    sample (int(''))."""
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("tokens", [torch.zeros(2, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long),
                                    torch.zeros(2, 5), torch.zeros(10, dtype=torch.long)])
def test_token_logprobs_refuse_tokens_that_are_not_the_logits_ids(tokens):
    """gather took tokens of fewer positions or rows than the logits: the log-probs of other positions, silently."""
    with pytest.raises(ValueError, match=r"tokens must be integer ids \[B, S\] of the logits' \(2, 5\)"):
        token_logprobs(torch.randn(2, 5, 7), tokens)


@pytest.mark.parametrize("shapes", [[(4,)], [(4,), (3,)], [(4, 4), (3,), (1,)]])
def test_a_master_adamw_state_of_other_parameters_is_refused_and_nothing_loaded(shapes):
    """zip dropped the extra master weights or left ours unloaded, and copy_ broadcast a [4] into a [4, 4]."""
    from megatron_trace.rl.trainer import MasterAdamW

    params = [torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(3))]
    opt = MasterAdamW(params, lr=1e-3)
    other = MasterAdamW([torch.nn.Parameter(torch.full(s, 7.0)) for s in shapes], lr=1e-3)
    with pytest.raises(ValueError, match=r"a state of other parameters; nothing loaded"):
        opt.load_state_dict(other.state_dict())
    assert all(torch.equal(m, torch.ones_like(m)) for m in opt.master)
    opt.release()
    other.release()
