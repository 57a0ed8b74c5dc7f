import pytest
import torch

from megatron_trace.rollout.base import SamplingParams
from megatron_trace.rollout.sampling import sample_tokens, top_p_filter


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.2, 0.5, 0.3]])
    assert torch.equal(top_p_filter(probs, 0.6), torch.tensor([[0.0, 0.5, 0.3]]))
    assert torch.equal(top_p_filter(probs, 0.5), torch.tensor([[0.0, 0.5, 0.0]]))  # 0.5 alone reaches 0.5
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_greedy_and_tiny_top_p_pick_argmax_with_untruncated_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    for params in (SamplingParams(temperature=0), SamplingParams(top_p=1e-6, seed=0)):
        tok, lp = sample_tokens(logits, params, torch.Generator().manual_seed(0))
        assert tok.tolist() == [1, 0]
        assert torch.allclose(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_temperature_scales_the_logprob():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.5)
    tok, lp = sample_tokens(logits, params, torch.Generator().manual_seed(0))
    assert torch.allclose(lp, torch.log_softmax(logits / 0.5, -1).gather(1, tok[:, None]).squeeze(1))


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3)
    tok, _ = sample_tokens(logits, SamplingParams(), torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=3).float() / tok.numel()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_nonfinite_rows_are_flagged_not_crashing_and_leave_other_rows_alone():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(2))
    bad = logits.clone()
    bad[1, 3], bad[3, 0] = float("nan"), float("inf")
    for params in (SamplingParams(), SamplingParams(temperature=0)):
        want, want_lp = sample_tokens(logits, params, torch.Generator().manual_seed(0))
        flags = torch.zeros(5, dtype=torch.bool)
        tok, lp = sample_tokens(bad, params, torch.Generator().manual_seed(0), nonfinite=flags)
        assert flags.tolist() == [False, True, False, True, False]
        ok = ~flags
        assert torch.equal(tok[ok], want[ok]) and torch.equal(lp[ok], want_lp[ok])
        assert not torch.isfinite(lp[flags]).any()  # the bad rows' log-probs stay non-finite
        assert ((tok >= 0) & (tok < 7)).all()


def test_top_p_truncates_the_temperature_scaled_distribution():
    """The nucleus is that of softmax(logits / T), the distribution sampled from: at T=0.25 the first token alone
    holds 0.98 of the mass (top_p=0.9 keeps only it), where the untempered softmax (0.67, 0.24, 0.09) would keep two;
    at T=4 (0.39, 0.30, 0.23, ...) top_p=0.5 keeps two where the untempered one would keep one."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(2000, 4)
    tok, _ = sample_tokens(logits, SamplingParams(temperature=0.25, top_p=0.9), torch.Generator().manual_seed(0))
    assert tok.eq(0).all()
    tok, _ = sample_tokens(logits, SamplingParams(temperature=4.0, top_p=0.5), torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=4).float() / tok.numel()
    p = torch.softmax(logits[0] / 4.0, -1)
    assert freq[2:].eq(0).all()
    assert torch.allclose(freq[:2], p[:2] / p[:2].sum(), atol=0.04)


@pytest.mark.parametrize("logits,nonfinite", [
    (torch.randn(5), None), (torch.randn(2, 3, 5), None), (torch.randn(2, 5), torch.zeros(3, dtype=torch.bool)),
    (torch.randn(2, 5), torch.zeros(2, dtype=torch.long)), (torch.randn(2, 5), torch.zeros(1, dtype=torch.bool)),
])
def test_sample_tokens_refuses_logits_and_flags_of_other_shapes(logits, nonfinite):
    """1-D logits sampled one scalar token for a batch; flags of other rows or dtype failed deep in torch."""
    with pytest.raises(ValueError, match=r"sample_tokens needs logits \[B, V\] and nonfinite None or bool \[B\]"):
        sample_tokens(logits, SamplingParams(), nonfinite=nonfinite)


def test_sample_tokens_refuses_params_that_are_no_sampling_params():
    with pytest.raises(TypeError, match="params must be SamplingParams, got dict"):
        sample_tokens(torch.randn(2, 5), {"temperature": 1.0})
