"""Issue 11 item 6: GRPO's G samples per prompt reuse one prefill; the prefix tokens' guidance and routing are
stored per KV slot: every prefix-hit sample has exactly the records of a cold prefill of its prompt."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.metrics import quant_counts
from megatron_trace.rollout import HFRolloutBackend, SamplingParams
from megatron_trace.rollout.recorder import GuidanceRecorder

from ..rollout._tiny import tiny_model
from ..rollout.test_hf_backend import full_forward

CFG = TraceConfig(guided_layers="all", cache_mode="full")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40]]
G = 3
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)


def _backend(prefix_reuse=True, config=CFG):
    return HFRolloutBackend(tiny_model(), mode="fp4", trace_config=config, dtype=torch.float32,
                            prefix_reuse=prefix_reuse)


def _grpo(prompts):
    return [p for p in prompts for _ in range(G)]  # G samples per prompt, as a GRPO driver builds them


def _prefill_tokens(be, prompts, sampling):
    """Tokens the first MoE layer processed in the first (prefill) forward of a generate call."""
    seen = []
    hook = be.model.model.layers[0].mlp.experts.register_forward_hook(lambda m, a, out: seen.append(a[0].shape[0]))
    out = be.generate(prompts, sampling)
    hook.remove()
    return seen[0], out


def _payload(rec):
    return rec.mantissa_bits if hasattr(rec, "mantissa_bits") else rec.codes


@pytest.mark.parametrize("cache_mode", ["full", "compact"])
def test_prefix_hits_have_the_cold_records(cache_mode):
    be = _backend(config=CFG.replace(cache_mode=cache_mode))
    width = max(map(len, PROMPTS))
    n_cold, cold = _prefill_tokens(be, PROMPTS, GREEDY)
    n_hit, hit = _prefill_tokens(be, _grpo(PROMPTS), GREEDY)
    assert (n_cold, n_hit) == (len(PROMPTS) * width, len(PROMPTS) * width)  # G x fewer prefill rows
    assert set(hit.guidance) == set(cold.guidance) == {(layer, s) for layer in range(3) for s in
                                                       ("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v")}
    for b in range(len(PROMPTS) * G):
        u, n = b // G, len(PROMPTS[b // G])
        for key, sg in hit.guidance.items():
            want, got = cold.guidance[key], sg
            assert got.valid[b, :n].all(), (b, key)  # no prefix row is missing
            assert torch.equal(_payload(got.record)[b, :n], _payload(want.record)[u, :n]), (b, key)
            assert torch.equal(got.record.block_scales[b, :n].view(torch.uint8),
                               want.record.block_scales[u, :n].view(torch.uint8)), (b, key)
            assert torch.equal(got.record.global_amax[b, :n], want.record.global_amax[u, :n]), (b, key)
        for layer, r in hit.routing.items():
            assert torch.equal(r[b, :n], cold.routing[layer][u, :n]), (b, layer)
        # the first response token comes from the shared prefill's logits: same token, same log-prob
        assert hit.tokens[b, n] == cold.tokens[u, n] and hit.logprobs[b, n] == cold.logprobs[u, n]


def test_forked_samples_decode_from_their_own_copy_of_the_prefix():
    """Sampled samples of one prompt diverge; each one's log-probs and records are those of a full forward
    over its own tokens (a KV row, routing or record forked to the wrong sample would show up here)."""
    be = _backend()
    out = be.generate(_grpo(PROMPTS), SamplingParams(max_new_tokens=6, seed=5))
    assert len({tuple(r) for r in out.responses()[:G]}) > 1  # the G samples of prompt 0 differ
    recorder = GuidanceRecorder(out.batch_size, be.guided_sites, compact=False)
    ref = full_forward(be, out, 1.0, recorder)
    m = out.response_mask
    assert torch.allclose(out.logprobs[m], ref[m], atol=1e-4)
    pos = torch.arange(out.tokens.shape[1]).expand_as(out.tokens)
    _, guidance = recorder.finish(pos, out.attention_mask)
    for key, site in out.guidance.items():
        assert torch.equal(site.valid, guidance[key].valid), key
        c = quant_counts(guidance[key].record, site.record, rows=site.valid)
        assert c.mismatched <= 0.01 * c.elements, key


def test_reuse_off_prefills_every_sample():
    be = _backend(prefix_reuse=False)
    n, out = _prefill_tokens(be, _grpo(PROMPTS), GREEDY)
    assert n == len(PROMPTS) * G * max(map(len, PROMPTS))
    assert all(sg.valid[out.attention_mask].all() for sg in out.guidance.values())


def test_bf16_mode_forks_its_plain_kv_cache_too():
    be = HFRolloutBackend(tiny_model(), mode="bf16", dtype=torch.float32)
    n, hit = _prefill_tokens(be, _grpo(PROMPTS), GREEDY)
    cold = be.generate(PROMPTS, GREEDY)
    assert n == len(PROMPTS) * max(map(len, PROMPTS)) and hit.guidance == {}
    for b in range(len(PROMPTS) * G):
        u, k = b // G, len(PROMPTS[b // G])
        assert all(torch.equal(r[b, :k], cold.routing[layer][u, :k]) for layer, r in hit.routing.items())
        assert hit.tokens[b, k] == cold.tokens[u, k] and hit.logprobs[b, k] == cold.logprobs[u, k]
