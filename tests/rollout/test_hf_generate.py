"""``generate`` against an independent greedy decode of the plain transformers model (no rollout numerics, no KV
cache: the whole sequence re-run per token): the right-padded tokens, the response mask, each row's stop, its
finish reason and the log-prob at each response position; and a NaN in the forward of the last token fed."""

import pytest
import torch

from megatron_trace.formats import NonFiniteError
from megatron_trace.rollout import HFRolloutBackend, SamplingParams
from megatron_trace.rollout.hf_weights import checkpoint_tensors

from ._tiny import tiny_model

# the last prompt repeats the first (a forked prefix); the second is the longest (the others are left-padded)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [40], [3, 4], [5, 6, 7]]
NEW = 6


def greedy_reference(prompt: list[int], n: int, seed: int = 0) -> tuple[list[int], list[float]]:
    """n greedy tokens of the plain HF model and their log-probs (log_softmax of the logits that chose them)."""
    model = tiny_model(seed=seed)
    seq, toks, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            t = int(logits.argmax())
            toks.append(t)
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            seq.append(t)
    return toks, lps


@pytest.fixture(scope="module")
def reference():
    return [greedy_reference(p, NEW) for p in PROMPTS[:4]]


@pytest.mark.parametrize("static_decode", ["off", "eager"])
def test_greedy_rollout_is_the_hf_models_greedy_decode_cut_at_each_rows_stop(reference, static_decode):
    ref = reference + [reference[0]]
    # stops: row 0 (and its copy) at its 3rd token, row 1 at its last (6th), row 2 at its 3rd; row 3 runs to the limit
    stop = (ref[0][0][2], ref[1][0][-1], ref[2][0][2])
    want = []
    for toks, lps in ref:
        cut = next((k + 1 for k, t in enumerate(toks) if t in stop), None)
        want.append((toks[:cut], lps[:cut], "length" if cut is None else "stop"))
    assert [len(w[0]) for w in want] == [3, 6, 3, 6, 3] and [w[2] for w in want].count("length") == 1, \
        "the reference decode no longer gives the stops this test is about"
    be = HFRolloutBackend(tiny_model(seed=0), mode="bf16", dtype=torch.float32, static_decode=static_decode)
    out = be.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0, stop_token_ids=stop))
    assert out.finish_reasons == tuple(w[2] for w in want)
    assert out.response_lens.tolist() == [len(w[0]) for w in want]
    assert out.tokens.shape == (len(PROMPTS), max(len(p) + len(w[0]) for p, w in zip(PROMPTS, want)))
    for i, (p, (toks, lps, _)) in enumerate(zip(PROMPTS, want)):
        end = len(p) + len(toks)
        assert out.tokens[i, :end].tolist() == p + toks, i
        assert out.tokens[i, end:].eq(be.pad_token_id).all(), i
        assert out.response_mask[i].nonzero().flatten().tolist() == list(range(len(p), end)), i
        assert out.attention_mask[i].nonzero().flatten().tolist() == list(range(end)), i
        torch.testing.assert_close(out.logprobs[i, len(p):end], torch.tensor(lps), atol=1e-4, rtol=0)
        assert out.logprobs[i, :len(p)].eq(0).all() and out.logprobs[i, end:].eq(0).all(), i


def test_a_nan_in_the_forward_of_the_last_token_fed_fails_the_batch(reference):
    """The token sampled at the last step is fed once more (its routing is recorded): NaN logits of that forward
    were not checked in bf16 mode (no FP4 quantize counters), and the batch came back with that row's routing taken
    from NaN router logits."""
    toks, _ = reference[1]
    last = toks[-1]
    assert last not in toks[:-1] and last not in PROMPTS[1], "the reference decode changed: pick another token"
    be = HFRolloutBackend(tiny_model(seed=0), mode="bf16", dtype=torch.float32)
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0)
    assert be.generate([PROMPTS[1]], sampling).responses()[0] == toks
    with torch.no_grad():
        be.model.model.embed_tokens.weight[last] = float("nan")  # only the last token fed sees it
    with pytest.raises(NonFiniteError, match=r"NaN/Inf logits for 1 of 1 prompt row"):
        be.generate([PROMPTS[1]], sampling)


def test_after_a_weight_update_the_batch_is_the_new_weights_greedy_decode_and_carries_their_version(reference):
    be = HFRolloutBackend(tiny_model(seed=0), mode="bf16", dtype=torch.float32)
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0)
    assert be.generate(PROMPTS[:1], sampling).policy_version == 0
    be.update_weights(checkpoint_tensors(tiny_model(seed=1)), version=3)
    out = be.generate(PROMPTS[:1], sampling)
    toks, lps = greedy_reference(PROMPTS[0], NEW, seed=1)
    assert toks != reference[0][0], "weights B must decode otherwise than A for this test to see them"
    assert out.responses()[0] == toks and out.policy_version == 3
    torch.testing.assert_close(out.logprobs[0, out.response_mask[0]], torch.tensor(lps), atol=1e-4, rtol=0)


def test_a_one_token_response_ends_by_its_stop_or_by_the_limit(reference):
    be = HFRolloutBackend(tiny_model(seed=0), mode="bf16", dtype=torch.float32)
    first = [toks[0] for toks, _ in reference]
    stop = (first[0],) if first[0] not in first[1:] else None
    assert stop is not None, "the reference decode changed: pick a stop token only row 0 starts with"
    out = be.generate(PROMPTS[:4], SamplingParams(max_new_tokens=1, temperature=0, stop_token_ids=stop))
    assert out.responses() == [[t] for t in first]
    assert out.finish_reasons == ("stop", "length", "length", "length")
