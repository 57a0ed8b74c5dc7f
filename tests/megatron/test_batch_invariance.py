"""Batch invariance of the guided Megatron forward (USER_NEEDS §12): guidance shipped through the cache and assembled
per micro-batch gives a sample the same trainer codes, scales, amax, valid flags and routing, and the same counts,
alone or beside other samples (other micro-batch sizes and orders, left or right padding, a packed row): the
counts of any split of a step add up to the same totals."""

import dataclasses
from collections import Counter

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.cache import GuidanceCache
from megatron_trace.guidance.records import pack_guidance
from megatron_trace.guidance.site import FallbackCounter
from megatron_trace.megatron import StepGuidance, find_trace_layers, trace_guidance
from megatron_trace.megatron.packing import pack_step

from .harness import LAYERS, SEQ, TOPK, packed_batch, padded_batch
from .test_packing import _model

pytestmark = pytest.mark.usefixtures("world1")

LENGTHS = (5, 9, 12, 7)  # the rollout batch's samples 0..3
HASH = 3  # the trainer holds other tokens for sample 3: its records are rejected (token_hash)


CASES = {  # trainer config, share of the rollout's rows marked not recorded
    "per_row": (TraceConfig(guided_layers="last_k", guided_last_k=2), 0.3),
    # a per-tensor amax over the micro-batch rounds only rows without a usable record (batch_amax_note): where
    # every real token's row is guided, nothing of a sample depends on its micro-batch either
    "per_tensor_all_guided": (TraceConfig(guided_layers="all", activation_amax="per_tensor"), 0.0),
}


@pytest.fixture(scope="module", params=list(CASES))
def step(request):
    """(trainer model; the rollout's tokens, mask and routing; the cache holding its full records (a slightly
    different model of the same recipe), some of their rows marked not recorded)."""
    tc, invalid = CASES[request.param]
    roll = _model(tc.replace(guided_layers="all"), init_method_std=0.051)
    tokens, tm, pos, mask = padded_batch(LENGTHS, left=False, seed=4)
    rec = _forward(roll, (tokens, pos, mask)).recorded()
    g = torch.Generator().manual_seed(1)
    sites = {k: dataclasses.replace(sg, valid=sg.valid & (torch.rand(sg.valid.shape, generator=g) >= invalid))
             for k, sg in rec.sites.items()}
    cache = GuidanceCache(budget_bytes=10**9)
    cache.put(0, pack_guidance(sites, tokens, version=0, attention_mask=tm))
    return _model(tc), tokens, tm, rec.routing, cache


def _forward(model, data, guidance=None):
    with trace_guidance(model, guidance, record=True, compact=False) as h, torch.no_grad():
        model(*data)
    return h


def _micro_batch(step, ids, layout: str):
    """Samples ``ids`` as one trainer micro-batch, ``layout`` "left" / "right" padded to SEQ or "packed" (one row,
    a padded segment each, tail padding): (model inputs, StepGuidance, each sample's token positions, assembly
    counter)."""
    _, tokens, tm, routing, cache = step
    B, left = len(ids), layout == "left"
    t, m = torch.zeros(B, SEQ, dtype=torch.long), torch.zeros(B, SEQ, dtype=torch.bool)
    replay = {layer: torch.zeros(B, SEQ, TOPK, dtype=torch.int64) for layer in routing}
    for r, i in enumerate(ids):
        at = slice(SEQ - LENGTHS[i], SEQ) if left else slice(0, LENGTHS[i])
        t[r, at], m[r, at] = tokens[i, tm[i]], True
        if i == HASH:
            t[r, at.start] += 1
        for layer, x in routing.items():
            replay[layer][r, at] = x[i, tm[i]]
    counter = FallbackCounter()
    sites = cache.assemble(0, list(ids), t, versions=0, counter=counter, attention_mask=m)
    guidance = StepGuidance(sites=sites, routing=replay, token_mask=m)
    pos = (m.long().cumsum(1) - 1).clamp(min=0)
    data = (t, pos.expand(3, B, SEQ), ~(torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None] & m[:, None]).unsqueeze(1))
    rows = [r * SEQ + m[r].nonzero().squeeze(1) for r in range(B)]
    if layout == "packed":
        cu = [0]
        for i in ids:
            cu.append(cu[-1] + LENGTHS[i] + 1)
        guidance, data = pack_step(guidance, cu, total=cu[-1] + 2), packed_batch(t, m, cu, cu[-1] + 2)
        rows = [torch.arange(c, c + LENGTHS[i]) for c, i in zip(cu, ids)]
    return data, guidance, rows, counter


def _sample(rec, rows):
    """A sample's rows of every recorded site and of the routing, batch-major rows flattened."""
    out = {}
    for key, sg in rec.sites.items():
        r = sg.record
        flat = lambda x: x.reshape(-1, *x.shape[2:])[rows]  # noqa: E731
        out[key] = (flat(r.codes), flat(r.block_scales.view(torch.uint8)), flat(r.global_amax), flat(sg.valid),
                    None if sg.expert_ids is None else flat(sg.expert_ids))
    for layer, x in rec.routing.items():
        out[layer] = (x.reshape(-1, TOPK)[rows],)
    return out


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a)


def test_a_samples_guided_forward_and_counts_are_the_same_in_any_micro_batch(step):
    """Per-row amax: every sample, its rows guided or not. Per-tensor amax: every sample whose rows are all guided;
    sample ``HASH`` (its records rejected: the trainer's own rounding, over the micro-batch's amax) is the
    dependence ``batch_amax_note`` names, and its rows do change with the micro-batch. Counts add up in both."""
    model = step[0]
    per_tensor = find_trace_layers(model).config.activation_amax == "per_tensor"
    changed = False
    alone, stats, assembly = {}, {}, {}
    for i in range(len(LENGTHS)):
        data, guidance, rows, counter = _micro_batch(step, [i], "right")
        h = _forward(model, data, guidance)
        alone[i], stats[i], assembly[i] = _sample(h.recorded(), rows[0]), Counter(h.stats()), counter
    assert len(alone[0]) == LAYERS * 4 + LAYERS
    assert stats[HASH][(2, "expert_fc1_in", "invalid_row")] == LENGTHS[HASH]  # (rejected at assembly)
    assert 0 < stats[0][(3, "kv_k", "used")] <= LENGTHS[0]
    for ids, layout in (([2, 0, 3, 1], "left"), ([1, 3], "right"), ([3, 1, 0], "packed"), ([0, 2, 1, 3], "right")):
        data, guidance, rows, counter = _micro_batch(step, ids, layout)
        h = _forward(model, data, guidance)
        rec = h.recorded()
        for i, r in zip(ids, rows):
            if per_tensor and i == HASH:
                changed |= not _same(_sample(rec, r), alone[i])
                continue
            assert _same(_sample(rec, r), alone[i]), (ids, layout, i)
        assert Counter(h.stats()) == sum((stats[i] for i in ids), Counter()), (ids, layout)
        want = FallbackCounter()
        for i in ids:
            want.add(assembly[i].used, dict(assembly[i].fallback))
        assert (counter.used, counter.fallback) == (want.used, want.fallback), (ids, layout)
    assert changed == per_tensor
