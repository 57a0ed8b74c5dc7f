import pytest
import torch

from megatron_trace.rollout.base import RolloutBatch, SamplingParams, check_prompts


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(stop_token_ids=(3, -1)), "stop_token_ids"),
        (dict(stop_token_ids=(True,)), "stop_token_ids"),
        (dict(seed="7"), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-1), "seed"),
        (dict(temperature=1e-40), r"temperature=1e-40 must be 0 \(greedy\) or a finite number >= 1e-05"),
    ],
)
def test_sampling_params_reject_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_defaults_and_vocab_check():
    p = SamplingParams(temperature=0, stop_token_ids=[5, 9])
    assert p.greedy and p.stop_token_ids == (5, 9)
    p.check_vocab(10)
    with pytest.raises(ValueError, match=r"\[9\].*\[0, 9\)"):
        p.check_vocab(9)


@pytest.mark.parametrize("prompts", [[], [[]], [[1, 200]], "abc", [[1, 2.0]]])
def test_check_prompts_rejects(prompts):
    with pytest.raises(ValueError, match="prompts"):
        check_prompts(prompts, vocab_size=128)


def test_check_prompts_accepts_tensors():
    check_prompts([torch.tensor([1, 2]), [3]], vocab_size=4)


@pytest.mark.parametrize("bad,ids", [(-1, "[-1]"), (128, "[128]"), (True, "[True]"), (3.0, "[3.0]")])
def test_check_prompts_names_the_bad_ids_among_many(bad, ids):
    """One bad id (out of range, a bool, a float) among 5000 valid ones is found and named."""
    prompt = list(range(100)) * 50
    check_prompts([prompt], vocab_size=128)
    prompt[4321] = bad
    with pytest.raises(ValueError, match=rf"prompts\[0\] has token id\(s\) \{ids[:-1]}\]"):
        check_prompts([prompt], vocab_size=128)


def test_check_prompts_accepts_int_subclasses():
    """An int subclass (not bool) is an id."""
    import enum

    class Tok(enum.IntEnum):
        A = 3

    check_prompts([[Tok.A, 5]], vocab_size=8)


def test_rollout_batch_validates_shapes():
    z = torch.zeros(2, 5)
    ok = dict(tokens=torch.zeros(2, 5, dtype=torch.long), prompt_lens=torch.tensor([2, 3]),
              response_lens=torch.tensor([3, 1]), response_mask=z.bool(), logprobs=z)
    b = RolloutBatch(**ok)
    assert b.seq_lens.tolist() == [5, 4]
    assert b.attention_mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    with pytest.raises(ValueError, match="logprobs"):
        RolloutBatch(**{**ok, "logprobs": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="routing"):
        RolloutBatch(**ok, routing={0: torch.zeros(2, 5, dtype=torch.long)})
