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


@pytest.mark.parametrize("bad,msg", [(-1, r"has token id\(s\) \[-1\] outside \[0, 128\)"),
                                     (128, r"has token id\(s\) \[128\] outside"),
                                     (True, r"holds True \(bool\), not an int token id"),
                                     (3.0, r"holds 3\.0 \(float\), not an int token id"),
                                     ([5, 6], r"holds \[5, 6\] \(list\), not an int token id")])
def test_check_prompts_names_the_bad_ids_among_many(bad, msg):
    """One bad id (out of range, a bool, a float, a nested list) among 5000 valid ones is found and named."""
    prompt = list(range(100)) * 50
    check_prompts([prompt], vocab_size=128)
    prompt[4321] = bad
    with pytest.raises(ValueError, match=rf"prompts\[0\] {msg}"):
        check_prompts([prompt], vocab_size=128)


def test_check_prompts_gives_python_ints_of_numpy_ids_and_tensors_and_checks_the_positions():
    import numpy as np

    got = check_prompts([np.array([5, 6]).tolist(), list(np.array([5, 6])), torch.tensor([7])], vocab_size=8)
    assert got == [[5, 6], [5, 6], [7]] and all(type(t) is int for p in got for t in p)
    assert check_prompts([[1] * 10], vocab_size=8, max_positions=16, max_new_tokens=6) == [[1] * 10]
    with pytest.raises(ValueError, match=r"prompts\[1\] has 10 tokens: with max_new_tokens=7 that is 17 positions, "
                                         r"beyond max_position_embeddings=16"):
        check_prompts([[1], [1] * 10], vocab_size=8, max_positions=16, max_new_tokens=7)


def test_one_stop_token_may_be_given_as_an_int():
    import numpy as np

    assert SamplingParams(stop_token_ids=3).stop_token_ids == (3,)
    assert SamplingParams(stop_token_ids=[np.int64(4)]).stop_token_ids == (4,)
    with pytest.raises(ValueError, match=r"stop_token_ids=3\.5 must be token ids"):
        SamplingParams(stop_token_ids=3.5)


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


def test_sampling_params_take_numpy_and_tensor_values_as_python_numbers():
    """A config read with NumPy (np.float32 temperature / top_p, np.int64 counts and seed) or stop ids as a tensor:
    valid values, not refused with an error that names them as if out of range."""
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float32(0.75), max_new_tokens=np.int64(8),
                       seed=np.int64(3), stop_token_ids=torch.tensor([2, 7]))
    assert (p.temperature, p.top_p, p.max_new_tokens, p.seed, p.stop_token_ids) == (0.5, 0.75, 8, 3, (2, 7))
    assert all(type(v) is t for v, t in ((p.temperature, float), (p.top_p, float), (p.max_new_tokens, int),
                                         (p.seed, int)))
    assert SamplingParams(stop_token_ids=torch.tensor(5)).stop_token_ids == (5,)
    with pytest.raises(ValueError, match=r"stop_token_ids has invalid id\(s\) \[2\.5\]"):
        SamplingParams(stop_token_ids=torch.tensor([2.5]))
