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

    got = check_prompts([np.array([5, 6]).tolist(), list(np.array([5, 6])), torch.tensor([7]), np.array([4, 3])],
                        vocab_size=8)  # (a NumPy array itself was refused as no list)
    assert got == [[5, 6], [5, 6], [7], [4, 3]] and all(type(t) is int for p in got for t in p)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds \[1, 2\] \(list\), not an int token id"):
        check_prompts([np.array([[1, 2]])], vocab_size=8)  # (2-D: one prompt of lists)
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


def test_sampling_params_bounds_are_exact():
    """The edges of each range: an infinite temperature or a bool is refused, the smallest temperature and the
    largest seed are taken, ``greedy`` is temperature 0 only."""
    import math

    from megatron_trace.rollout.base import MIN_TEMPERATURE

    for kw, field in ((dict(temperature=math.inf), r"temperature=inf must be 0"), (dict(temperature=True), "temper"),
                      (dict(top_p=True), r"top_p=True must be in \(0, 1\]"), (dict(seed=2**63), r"2\*\*63\)"),
                      (dict(max_new_tokens=True), "max_new_tokens=True")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    p = SamplingParams(temperature=MIN_TEMPERATURE, top_p=1.0, seed=2**63 - 1, max_new_tokens=1)
    assert not p.greedy and p.seed == 2**63 - 1 and SamplingParams(temperature=0.0).greedy
    SamplingParams(stop_token_ids=(0,)).check_vocab(1)


def test_responses_are_the_tokens_after_each_prompt():
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    b = RolloutBatch(tokens=tokens, prompt_lens=torch.tensor([2, 1]), response_lens=torch.tensor([3, 2]),
                     response_mask=torch.zeros(2, 5, dtype=torch.bool), logprobs=torch.zeros(2, 5))
    assert b.responses() == [[3, 4, 5], [7, 8]] and b.batch_size == 2
    with pytest.raises(ValueError, match=r"routing\[3\] shape \(2, 4, 2\) is not \[2, 5, topk\]"):
        RolloutBatch(tokens=tokens, prompt_lens=torch.tensor([2, 1]), response_lens=torch.tensor([3, 2]),
                     response_mask=torch.zeros(2, 5, dtype=torch.bool), logprobs=torch.zeros(2, 5),
                     routing={3: torch.zeros(2, 4, 2, dtype=torch.long)})


def test_weight_pairs_refuse_what_is_not_a_name_tensor_pair():
    from megatron_trace.rollout.base import weight_pairs

    w = torch.zeros(2)
    assert weight_pairs(iter([("a", w), ["b", w]])) == [("a", w), ["b", w]]
    with pytest.raises(TypeError, match=r"got a dict: pass weights.items\(\)"):
        weight_pairs({"a": w})
    with pytest.raises(TypeError, match=r"weights\[1\] must be a \(name, tensor\) pair"):
        weight_pairs([("a", w), ("b", w, w)])
    with pytest.raises(TypeError, match=r"weights\[0\] must be a \(name, tensor\) pair .* got Tensor"):
        weight_pairs([w])


def test_nonfinite_names_check_each_tensor_in_the_dtype_it_loads_as():
    """An Inf (not only a NaN) is named, and so is a finite value that overflows the target dtype; int tensors and
    finite ones are not."""
    from megatron_trace.rollout.base import nonfinite_names

    items = [("ok", torch.ones(3), None), ("inf", torch.tensor([1.0, -float("inf")]), None),
             ("nan", torch.tensor([float("nan")]), torch.bfloat16), ("big", torch.tensor([7e4]), torch.float16),
             ("fits", torch.tensor([7e4]), torch.bfloat16), ("ids", torch.arange(3), None),
             ("f8", torch.tensor([1.0]).to(torch.float8_e4m3fn), None)]
    assert nonfinite_names(items) == ["inf", "nan", "big"]


def test_policy_versions_only_grow_unless_reset():
    from megatron_trace.rollout.base import next_policy_version

    assert next_policy_version(3, None) == 4 and next_policy_version(3, 7) == 7
    assert next_policy_version(3, 0, reset=True) == 0 and next_policy_version(3, 3, reset=True) == 3
    for version, match in ((3, "version=3 is not newer than the rollout's policy_version=3"),
                           (2, "version=2 is not newer"), (-1, r"version=-1 must be None or an int >= 0"),
                           (True, "version=True must be None")):
        with pytest.raises(ValueError, match=match):
            next_policy_version(3, version)
    with pytest.raises(ValueError, match="reset=1 must be a bool"):
        next_policy_version(3, 5, reset=1)
    with pytest.raises(ValueError, match="reset=True needs the version"):
        next_policy_version(3, None, reset=True)


def test_a_failed_update_keeps_the_trainer_recipe():
    from types import SimpleNamespace

    from megatron_trace.rollout.base import recipe_kept_on_failure

    be = SimpleNamespace(trainer_recipe="old")
    with pytest.raises(RuntimeError, match="refused"), recipe_kept_on_failure(be):
        be.trainer_recipe = "new"
        raise RuntimeError("refused")
    assert be.trainer_recipe == "old"
    with recipe_kept_on_failure(be):
        be.trainer_recipe = "new"
    assert be.trainer_recipe == "new"
