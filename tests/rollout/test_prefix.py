"""``rollout.prefix``: only identical prompts share a prefill (a prompt differing in one token, its first, its last,
or only in its length is its own), and a forked batch is the batch without the fork."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.rollout import HFRolloutBackend, SamplingParams
from megatron_trace.rollout.prefix import shared_prompts

from ._tiny import tiny_model

# near-duplicates of [5, 6, 7]: the last token, the first token, a prefix, an extension; then repeats
NEAR = [[5, 6, 7], [5, 6, 8], [4, 6, 7], [5, 6], [5, 6, 7, 7], [5, 6, 8], [5, 6, 7], [4, 6, 7]]


def test_only_identical_prompts_share_a_row_in_first_appearance_order():
    fork = shared_prompts(NEAR)
    assert fork.first.tolist() == [0, 1, 2, 3, 4]
    assert fork.inverse.tolist() == [0, 1, 2, 3, 4, 1, 0, 2]
    assert fork.num_unique == len({tuple(p) for p in NEAR})
    for b, u in enumerate(fork.inverse.tolist()):  # every sample's row computes exactly its prompt
        assert NEAR[fork.first[u]] == NEAR[b]
    assert shared_prompts(NEAR[:5]) is None  # all distinct: nothing to fork
    assert shared_prompts([[3], [3]]).inverse.tolist() == [0, 0]


@pytest.mark.parametrize("mode", ["fp4", "bf16"])
def test_a_forked_batch_is_the_batch_without_the_fork(mode):
    """Greedy rollouts of near-duplicate prompts with prefix reuse equal those without it: tokens, masks,
    routing and guidance records; log-probs within float rounding (the decode batch is the same, the prefill
    batch holds each distinct prompt once)."""
    cfg = TraceConfig(guided_layers="all", cache_mode="full")
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    out = {}
    for reuse in (True, False):
        be = HFRolloutBackend(tiny_model(), mode=mode, trace_config=cfg, dtype=torch.float32, prefix_reuse=reuse)
        out[reuse] = be.generate(NEAR, greedy)
    hit, cold = out[True], out[False]
    assert torch.equal(hit.tokens, cold.tokens) and torch.equal(hit.response_mask, cold.response_mask)
    assert torch.allclose(hit.logprobs, cold.logprobs, atol=1e-5)
    assert hit.responses()[0] != hit.responses()[1] or hit.responses()[0] != hit.responses()[2]
    assert set(hit.routing) == set(cold.routing)
    for layer, r in hit.routing.items():
        assert torch.equal(r, cold.routing[layer]), layer
    assert set(hit.guidance) == set(cold.guidance)
    for key, site in hit.guidance.items():  # (the records themselves too: only their valid rows were compared)
        want = cold.guidance[key]
        assert torch.equal(site.valid, want.valid), key
        assert torch.equal(site.record.codes, want.record.codes), key
        assert torch.equal(site.record.block_scales.view(torch.uint8), want.record.block_scales.view(torch.uint8)), key
