"""Each metric of METRICS.md on hand-made inputs, against an independent plain-Python computation."""

import math
from collections import Counter

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.formats import FP4Tensor, e2m1
from megatron_trace.guidance.site import FallbackCounter, SiteGuidance
from megatron_trace.metrics import (
    QuantCounts,
    cache_metrics,
    guidance_step_metrics,
    guided_fallback_rate,
    mismatch_metrics,
    quant_counts,
    quant_metrics,
    token_mult_prob_error,
    trainer_counts_from_guidance,
)

# two sequences; seq 0 has a 1-token prompt, seq 1 a 2-token prompt
MASK = torch.tensor([[False, True, True, True], [False, False, True, True]])
LR = torch.tensor([[-9.0, -1.0, -1.5, -0.7], [-9.0, -9.0, -2.0, -0.3]])
D = {(0, 1): 0.1, (0, 2): -0.2, (0, 3): 1.0, (1, 2): -0.8, (1, 3): 0.0}


def _lt():
    lt = LR.clone()
    lt[0, 0] = lt[1, 0] = lt[1, 1] = 5.0  # prompt positions: must be ignored
    for (b, t), d in D.items():
        lt[b, t] = LR[b, t] + d
    return lt


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(_lt(), LR, MASK)
    d = list(D.values())
    r = [math.exp(x) for x in d]
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(((0.1 + 0.2 + 1.0) / 3 + (0.8 + 0.0) / 2) / 2)
    assert m["mismatch/logprob_abs_diff_token_mean"] == pytest.approx(sum(map(abs, d)) / 5)
    assert m["mismatch/logprob_abs_diff_token_max"] == pytest.approx(1.0)
    assert m["mismatch/kl_k1"] == pytest.approx(-sum(d) / 5)
    assert m["mismatch/kl_k3"] == pytest.approx(sum(ri - di - 1 for ri, di in zip(r, d)) / 5)
    assert m["mismatch/is_ratio_min"] == pytest.approx(math.exp(-0.8))
    assert m["mismatch/is_ratio_max"] == pytest.approx(math.e)
    assert m["mismatch/is_ratio_mean"] == pytest.approx(sum(r) / 5)
    assert m["mismatch/is_frac_outside_0.5_2"] == pytest.approx(2 / 5)  # e^1 > 2, e^-0.8 < 0.5
    mw = sum(r) / 5
    assert m["mismatch/ess"] == pytest.approx(1 / (sum((w / mw) ** 2 for w in r) / 5))
    assert m["mismatch/seq_logratio_abs_mean"] == pytest.approx((0.9 + 0.8) / 2)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(x)) for x in d) / 5)
    assert m["mismatch/frac_abs_diff_gt_ln2"] == pytest.approx(2 / 5)
    assert m["mismatch/first_token_abs_diff"] == pytest.approx((0.1 + 0.8) / 2)
    pt = [math.exp(LR[b, t].item() + x) for (b, t), x in D.items()]
    pr = [math.exp(LR[b, t].item()) for (b, t) in D]
    mt, mr = sum(pt) / 5, sum(pr) / 5
    cov = sum((a - mt) * (b - mr) for a, b in zip(pt, pr))
    pearson = cov / math.sqrt(sum((a - mt) ** 2 for a in pt) * sum((b - mr) ** 2 for b in pr))
    assert m["mismatch/prob_pearson"] == pytest.approx(pearson)
    assert token_mult_prob_error(_lt(), LR, MASK) == pytest.approx(m["mismatch/token_mult_prob_error"])
    assert all(isinstance(v, float) for v in m.values())


def test_identical_logprobs_are_the_floor():
    m = mismatch_metrics(LR, LR, MASK)
    for k in ("logprob_abs_diff", "logprob_abs_diff_token_max", "kl_k1", "kl_k3", "is_frac_outside_0.5_2",
              "seq_logratio_abs_mean", "frac_abs_diff_gt_ln2", "first_token_abs_diff"):
        assert m[f"mismatch/{k}"] == 0.0
    assert m["mismatch/ess"] == pytest.approx(1.0)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(1.0)
    assert m["mismatch/prob_pearson"] == pytest.approx(1.0)


def test_mismatch_metrics_ignore_what_lies_outside_the_mask():
    # NaN / -inf rollout log-probs at prompt or padding positions are selected away, not multiplied by 0
    lr = LR.masked_fill(~MASK, float("nan"))
    lr[0, 0] = float("-inf")
    lt = _lt().masked_fill(~MASK, float("inf"))
    assert mismatch_metrics(lt, lr, MASK) == mismatch_metrics(_lt(), LR, MASK)


@pytest.mark.parametrize("side", ["trainer", "rollout"])
@pytest.mark.parametrize("at", [(0, 2), (1, 2)], ids=["decode", "first"])
def test_a_nan_log_prob_in_the_mask_makes_every_token_statistic_nan(side, at):
    """A NaN log-prob of a response token: the token shares (``is_frac_outside_0.5_2``, ``frac_abs_diff_gt_ln2``) read
    the other tokens' share, e.g. 2/5 (a NaN compares False: counted as inside the bounds), while every mean, extreme
    and ratio was NaN; they are NaN too now. Only ``first_token_abs_diff`` keeps its value when the NaN is not at a
    first response token."""
    lt, lr = _lt(), LR.clone()
    (lt if side == "trainer" else lr)[at] = float("nan")
    m = mismatch_metrics(lt, lr, MASK)
    finite = {"mismatch/first_token_abs_diff"} if at == (0, 2) else set()
    assert {k for k, v in m.items() if not math.isnan(v)} == finite, m
    if finite:
        assert m["mismatch/first_token_abs_diff"] == pytest.approx((0.1 + 0.8) / 2)


def test_ess_clamps_ratios_at_5():
    lr = torch.zeros(1, 2)
    lt = torch.tensor([[3.0, 0.0]])  # r = e^3 ~ 20 -> clamped to 5
    m = mismatch_metrics(lt, lr, torch.ones(1, 2, dtype=torch.bool))
    w = [5.0, 1.0]  # mean 3
    assert m["mismatch/ess"] == pytest.approx(1 / sum((wi / 3) ** 2 for wi in w) * 2)
    assert m["mismatch/is_ratio_max"] == pytest.approx(math.exp(3))
    assert m["mismatch/is_ratio_mean"] == pytest.approx((math.exp(3) + 1) / 2)  # the raw ratios: only ESS clamps



def test_ess_clamps_small_ratios_at_one_fifth():
    lr = torch.zeros(1, 2)
    lt = torch.tensor([[-3.0, 0.0]])  # r = e^-3 ~ 0.05 -> clamped to 0.2
    m = mismatch_metrics(lt, lr, torch.ones(1, 2, dtype=torch.bool))
    w = [0.2, 1.0]  # mean 0.6
    assert m["mismatch/ess"] == pytest.approx(1 / (sum((wi / 0.6) ** 2 for wi in w) / 2))
    assert m["mismatch/is_ratio_min"] == pytest.approx(math.exp(-3))

@pytest.mark.parametrize("bad", ["shape", "empty", "dtype"])
def test_mismatch_metrics_reject_bad_input(bad):
    lt, lr, mask = _lt(), LR, MASK
    if bad == "shape":
        lr = LR[:, :3]
    elif bad == "empty":
        mask = torch.zeros_like(MASK)
    else:
        mask = MASK.float()
    with pytest.raises(ValueError):
        mismatch_metrics(lt, lr, mask)


@pytest.mark.parametrize("args,match", [
    # were accepted: int log-probs truncated (a diff of 0 where the values differ), complex ones cast to their real part
    (lambda: (_lt().long(), LR.long(), MASK), "trainer log-probs must be a floating-point tensor .*got torch.int64"),
    (lambda: (_lt(), LR.to(torch.complex64), MASK), "rollout log-probs must be a floating-point .*got torch.complex64"),
    (lambda: (_lt().tolist(), LR, MASK), "trainer log-probs must be a floating-point tensor .*got list"),
    (lambda: (_lt(), LR, MASK.tolist()), "mask must be a bool tensor .*got list"),
], ids=["int", "complex", "list", "mask-list"])
def test_mismatch_metrics_name_log_probs_of_the_wrong_type(args, match):
    with pytest.raises(ValueError, match=match):
        mismatch_metrics(*args())


def _fp4(codes_rows, scale_values, amax=2688.0):
    """FP4Tensor [rows, 16] from unpacked code rows, one E4M3 scale per row, per-tensor amax
    (2688 = 448 * 6 makes the encode scale 1: effective scale == block scale)."""
    codes = torch.tensor(codes_rows, dtype=torch.uint8)
    return FP4Tensor(codes=e2m1.pack(codes), block_scales=torch.tensor(scale_values).unsqueeze(1).to(
        torch.float8_e4m3fn), global_amax=torch.tensor(amax), shape=tuple(codes.shape), fmt="nvfp4")


def _pair():
    base = [2] * 16  # value 1.0 everywhere
    t_row0, r_row0 = list(base), list(base)
    r_row0[0] = 3  # 1.5: adjacent to 1.0
    r_row0[1] = 5  # 3.0: three grid points away
    t_row0[2], r_row0[2] = 0, 8  # +0 vs -0: equal values, not a mismatch
    trainer = _fp4([t_row0, base], [1.0, 2.0])
    rollout = _fp4([r_row0, base], [1.0, 4.0])  # row 1: same codes, different scale
    return trainer, rollout


def test_quant_counts_by_hand():
    trainer, rollout = _pair()
    c = quant_counts(trainer, rollout)
    assert (c.elements, c.mismatched, c.adjacent, c.blocks, c.scale_mismatched) == (32, 2, 1, 2, 1)
    rates = c.rates()
    assert rates["code_mismatch_rate"] == 2 / 32
    assert rates["adjacent_share"] == 0.5
    assert rates["scale_mismatch_rate"] == 0.5
    xt, xr = trainer.dequantize(), rollout.dequantize()  # independent path
    assert rates["d_act_rel"] == pytest.approx(float((xt - xr).norm() / xr.norm()))



def test_adjacent_means_one_signed_grid_point_apart():
    """Adjacent = neighbours on the signed E2M1 grid (-6 .. -0.5, 0, 0.5 .. 6), by hand: 1.0 vs 1.5 and 0.5 vs 0 are
    adjacent; 1.0 vs 2.0 (two points), 0.5 vs -0.5 (across 0: two points) and 1.0 vs 3.0 (three) are not."""
    t_row, r_row = [2] * 16, [2] * 16
    r_row[0] = 3  # 1.5: adjacent
    r_row[1] = 4  # 2.0: two grid points away
    t_row[2], r_row[2] = 1, 0  # 0.5 vs +0: adjacent
    t_row[3], r_row[3] = 1, 9  # 0.5 vs -0.5: two apart
    r_row[4] = 5  # 3.0: three apart
    c = quant_counts(_fp4([t_row], [1.0]), _fp4([r_row], [1.0]))
    assert (c.mismatched, c.adjacent) == (5, 2)

def test_quant_counts_row_selection_and_compact():
    trainer, rollout = _pair()
    c = quant_counts(trainer, rollout, rows=torch.tensor([False, True]))
    assert (c.elements, c.mismatched, c.blocks, c.scale_mismatched) == (16, 0, 1, 1)
    compact = rollout.guidance(compact=True)
    c = quant_counts(trainer, compact)
    assert (c.elements, c.blocks, c.scale_mismatched) == (0, 2, 1)
    with pytest.raises(ValueError, match="same rows"):
        quant_counts(trainer, _fp4([[2] * 16], [1.0]))


@pytest.mark.parametrize("rows", [torch.tensor([1, 0]), torch.tensor([0.5, 0.0]), [False, True]], ids=str)
def test_quant_counts_rows_must_be_a_bool_mask(rows):
    """(was: ``rows.bool()``: row ids [1, 0] (or weights) taken as the mask [True, False], silently)"""
    trainer, rollout = _pair()
    with pytest.raises(ValueError, match=r"rows must be a bool mask over the leading dims \(2,\), got"):
        quant_counts(trainer, rollout, rows=rows)


def test_quant_metrics_names_and_weighting():
    a = QuantCounts(elements=100, mismatched=10, adjacent=10, blocks=10, scale_mismatched=1, diff_sq=1.0, ref_sq=4.0)
    b = QuantCounts(elements=300, mismatched=10, adjacent=5, blocks=30, scale_mismatched=0, diff_sq=0.0, ref_sq=12.0)
    m = quant_metrics({(0, "expert_fc1_in"): a, (1, "expert_fc1_in"): b})
    assert m["quant/expert_fc1_in/layer_0/code_mismatch_rate"] == 0.1
    assert m["quant/expert_fc1_in/layer_1/adjacent_share"] == 0.5
    assert m["quant/expert_fc1_in/code_mismatch_rate"] == 20 / 400
    assert m["quant/expert_fc1_in/adjacent_share"] == 15 / 20
    assert m["quant/expert_fc1_in/scale_mismatch_rate"] == 1 / 40
    assert m["quant/expert_fc1_in/d_act_rel"] == pytest.approx(math.sqrt(1 / 16))


def test_trainer_counts_from_guidance():
    g = torch.Generator().manual_seed(0)
    q = TraceConfig().activation_quantizer()
    x_roll = torch.randn(2, 5, 64, generator=g)  # expert_fc1_in layout [B, S, hidden]
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, 3:] = False
    site = SiteGuidance(q.quantize(x_roll).guidance(compact=False), valid)
    same = trainer_counts_from_guidance(x_roll, site, q)
    assert same.mismatched == 0 and same.scale_mismatched == 0 and same.elements == 8 * 64
    x_train = x_roll + 0.02 * torch.randn(x_roll.shape, generator=g)
    own = trainer_counts_from_guidance(x_train, site, q)
    guided = trainer_counts_from_guidance(x_train, site, q, guided=True)
    assert own.mismatched > 0 and own.adjacent / own.mismatched > 0.9
    assert guided.mismatched < own.mismatched and guided.scale_mismatched == 0


def test_fallback_and_cache_metrics():
    assert guided_fallback_rate(FallbackCounter(used=3, fallback=Counter(missing=1))) == {
        "quant/guided_fallback_rate": 0.25}
    # rows of layers outside the policy are not guided sites: no log reports them as missing coverage
    c = FallbackCounter(used=6, fallback=Counter(not_guided_layer=6, missing=2))
    assert c.coverage == c.as_dict()["guidance/coverage"] == guidance_step_metrics(c)["guidance/coverage"] == 0.75
    assert cache_metrics(1024, 4096) == {"cache/bytes_per_token": 1024.0, "cache/bytes_per_token_full": 4096.0}


def test_counter_log_keys_are_the_step_metrics_keys():
    """``FallbackCounter.as_dict`` (the assembly's log) and ``guidance_step_metrics`` (the trainer's) name a reason the
    same way, so one dashboard query finds it in both: every key of the first is in the second, same value."""
    c = FallbackCounter(used=5, fallback=Counter(not_guided_layer=4, missing=2, token_hash=1))
    logged, step = c.as_dict("guidance/x"), guidance_step_metrics(c, prefix="guidance/x")
    assert logged["guidance/x/fallback/token_hash"] == 1.0
    assert {k: step[k] for k in logged} == logged


def test_per_site_coverage_counts_used_rows_only_at_guided_layers():
    """By hand from ``TraceStep.stats()``-shaped counts: fc1 used 6 rows, 2 fell back ``missing`` -> 6 / 8; fc2 only
    at a layer outside the policy (not a guided site) gets no coverage entry (it is not 1.0 of nothing)."""
    stats = {(0, "expert_fc1_in", "used"): 6, (0, "expert_fc1_in", "missing"): 2,
             (1, "expert_fc2_in", "not_guided_layer"): 5, (1, "expert_fc1_in", "not_guided_layer"): 4}
    counter = FallbackCounter(used=6, fallback=Counter(missing=2, not_guided_layer=9))
    m = guidance_step_metrics(counter, stats)
    assert m["guidance/coverage/expert_fc1_in"] == 6 / 8
    assert "guidance/coverage/expert_fc2_in" not in m
    assert m["guidance/coverage"] == 6 / 8 and m["guidance/rows_used"] == 6.0


def test_a_row_without_response_tokens_changes_no_metric():
    """A padding row (all prompt, or an empty slot of the batch) has no response token: the per-sequence means are
    over the sequences that have one (not a 0 / 0 NaN, not a zero diluting the mean), whatever its log-probs."""
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.bool)])
    lt = torch.cat([_lt(), torch.full((1, 4), 3.0)])
    lr = torch.cat([LR, torch.full((1, 4), -7.0)])
    with_pad, without = mismatch_metrics(lt, lr, mask), mismatch_metrics(_lt(), LR, MASK)
    assert with_pad == without
    assert with_pad["mismatch/seq_logratio_abs_mean"] == pytest.approx((0.9 + 0.8) / 2)
