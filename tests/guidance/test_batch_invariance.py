"""Batch invariance of the trainer's assembly (USER_NEEDS §12): a sample's assembled guidance and the rows counted
for it do not depend on the micro-batch it lands in (alone, beside others, in another order, left- or right-padded),
so the counts of any split of a step into micro-batches add up to the same totals, on every storage path."""

import pytest
import torch

from megatron_trace.guidance.cache import GuidanceCache
from megatron_trace.guidance.packed_assemble import assemble_packed
from megatron_trace.guidance.records import pack_guidance, payload_of, split_batch
from megatron_trace.guidance.site import FallbackCounter

from ._data import DIMS, make_batch

IDS = [10, 11, 12, 13]  # the rollout batch's samples; 99: a sample the step does not have
LENGTHS = [9, 6, 4, 7]
ROWS_PER_TOKEN = 2 * (1 + DIMS["topk"] + 1 + 1)  # layers 0 and 2: FC1, FC2 (top-k), K, V


@pytest.fixture(scope="module")
def rollout():
    batch, _, tok, mask = make_batch(B=4, S=9, lengths=LENGTHS)
    g = torch.Generator().manual_seed(5)
    for sg in batch.values():  # rows the rollout could not record
        sg.valid.logical_and_(torch.rand(sg.valid.shape, generator=g) > 0.2)
    return batch, tok, mask


def _assembler(path, rollout, tmp_path):
    """assemble(sample_ids, token_ids, mask, counter) of one storage path."""
    batch, tok, mask = rollout
    kw = dict(version=0, attention_mask=mask, sample_ids=IDS)
    if path == "shard_columns":
        parts = [pack_guidance(batch, tok, **kw)]
        return lambda ids, t, m, c: assemble_packed(parts, ids, t, versions=0, counter=c, attention_mask=m)
    cache = GuidanceCache(budget_bytes=0 if path == "spilled" else 10**9, cache_dir=tmp_path)
    if path == "columns":
        cache.put(0, pack_guidance(batch, tok, **kw))
    else:  # per sample (two puts), or spilled to a shard
        samples = split_batch(batch, tok, **kw)
        cache.put(0, samples[:2])
        cache.put(0, samples[2:])
    return lambda ids, t, m, c: cache.assemble(0, ids, t, versions=0, counter=c, attention_mask=m)


def _micro_batch(rollout, ids, left: bool):
    """The trainer's rows of samples ``ids`` (None and 99: a row of 5 tokens without a sample), left- or
    right-padded to 11 positions: (token ids, mask)."""
    _, tok, mask = rollout
    S = 11
    t, m = torch.zeros(len(ids), S, dtype=torch.long), torch.zeros(len(ids), S, dtype=torch.bool)
    for r, sid in enumerate(ids):
        src = tok[IDS.index(sid), mask[IDS.index(sid)]].clone() if sid in IDS else torch.arange(1, 6)
        if sid == 11:  # the trainer holds other tokens for sample 11: its records are rejected (token_hash)
            src[2] += 1
        at = slice(S - src.numel(), S) if left else slice(0, src.numel())
        t[r, at], m[r, at] = src, True
    return t, m


def _rows(out, r, m):
    """Row r's token rows of every assembled site: (payload, scale bytes, amax, valid, expert ids)."""
    return {k: tuple(None if x is None else x[r][m[r]] for x in (payload_of(sg.record),
            sg.record.block_scales.view(torch.uint8), sg.record.global_amax, sg.valid, sg.expert_ids))
            for k, sg in out.items()}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a)


@pytest.mark.parametrize("path", ["columns", "per_sample", "spilled", "shard_columns"])
def test_a_samples_assembly_and_counts_are_the_same_in_any_micro_batch(rollout, path, tmp_path):
    """Each row assembled alone, then in micro-batches of other sizes, orders and padding sides: the same rows
    (payload, scales, amax, valid flags, expert ids) and the same counts, which add up over any split. A row
    without a sample (None, or an id the step does not have) counts every row the step's keys quantize, alone
    as beside samples with records (it was counted once per token when its micro-batch had no record)."""
    asm = _assembler(path, rollout, tmp_path)
    alone, counts = {}, {}
    for sid in [*IDS, 99, None]:
        t, m = _micro_batch(rollout, [sid], left=False)
        c = FallbackCounter()
        alone[sid] = _rows(asm([sid], t, m, c), 0, m)
        counts[sid] = (c.used, dict(c.fallback))
    assert counts[99] == counts[None] == (0, {"missing": 5 * ROWS_PER_TOKEN})
    assert counts[11] == (0, {"token_hash": LENGTHS[1] * ROWS_PER_TOKEN})
    assert set(counts[10][1]) == {"not_recorded"} and counts[10][0] > 0
    for ids, left in (([13, 99, 10, 12], True), ([None, 12, 11], False), ([10, 11, 12, 13, 99, None], True),
                      ([12, 10], False)):
        t, m = _micro_batch(rollout, ids, left)
        c = FallbackCounter()
        out = asm(ids, t, m, c)
        for r, sid in enumerate(ids):
            got = _rows(out, r, m)
            if alone[sid]:
                assert _same(got, alone[sid]), (ids, sid)
            else:  # no record alone: beside samples with records its rows are zero and invalid
                assert all(not v[3].any() and not v[0].any() for v in got.values()), (ids, sid)
        used = sum(counts[s][0] for s in ids)
        reasons = {}
        for s in ids:
            for k, v in counts[s][1].items():
                reasons[k] = reasons.get(k, 0) + v
        assert (c.used, dict(c.fallback)) == (used, reasons), ids


def test_columns_assemble_at_the_keys_of_every_part():
    """``keys`` None: the keys of all of ``parts`` (the step's shards), not of the first alone: a micro-batch's rows
    are counted ``missing`` at a key only another part holds, as they would be in a micro-batch beside its samples."""
    batch, _, tok, mask = make_batch(B=2, S=9, lengths=[9, 6], layers=(0, 1), sites=("expert_fc1_in",))
    first = {k: v for k, v in batch.items() if k[0] == 0}
    second = {k: v for k, v in batch.items() if k[0] == 1}
    T = int(mask.sum())
    for parts in ([pack_guidance(first, tok, version=0, attention_mask=mask, sample_ids=[0, 1]),
                   pack_guidance(second, tok, version=0, attention_mask=mask, sample_ids=[2, 3])],
                  [pack_guidance(second, tok, version=0, attention_mask=mask, sample_ids=[2, 3]),
                   pack_guidance(first, tok, version=0, attention_mask=mask, sample_ids=[0, 1])]):
        counter = FallbackCounter()
        out = assemble_packed(parts, [0, 1], tok, versions=0, counter=counter, attention_mask=mask)
        assert list(out) == [(0, "expert_fc1_in")]
        assert (counter.used, dict(counter.fallback)) == (T, {"missing": T})


def test_columns_without_any_column_count_each_token_missing_once():
    """No part holds a column and no keys are named: every token is counted ``missing`` once (coverage 0, as
    ``records.assemble`` counts it), not nothing (coverage read from no rows at all)."""
    _, _, tok, mask = make_batch(B=2, S=9, lengths=[9, 6], layers=())
    counter = FallbackCounter()
    assert assemble_packed([], [0, 1], tok, versions=0, counter=counter, attention_mask=mask) == {}
    assert (counter.used, dict(counter.fallback)) == (0, {"missing": int(mask.sum())})


@pytest.mark.parametrize("columns", [False, True], ids=["samples", "columns"])
def test_a_step_keeps_the_fc2_top_k_of_its_first_put_that_has_one(columns):
    """A later put of the step without FC2 records (samples whose FC2 site was not recorded) leaves the step's FC2
    top-k as it was: a micro-batch of those samples counts ``topk`` ``missing`` rows per token at the step's FC2 key,
    as it would beside samples that have one (it raised 'pass topk=' once the top-k was forgotten)."""
    sites = ("expert_fc1_in", "expert_fc2_in")
    full, _, tok, mask = make_batch(B=2, S=9, lengths=[9, 6], layers=(0,), sites=sites)
    fc1 = {k: v for k, v in full.items() if k[1] == "expert_fc1_in"}
    cache = GuidanceCache(budget_bytes=10**9)
    for batch, ids in ((full, [0, 1]), (fc1, [2, 3])):
        kw = dict(version=0, attention_mask=mask, sample_ids=ids)
        if columns:
            cache.put(0, pack_guidance(batch, tok, **kw))
        else:  # one sample a put (a whole split batch is kept as its columns)
            for sample in split_batch(batch, tok, **kw):
                cache.put(0, [sample])
    counter = FallbackCounter()
    out = cache.assemble(0, [2, 3], tok, versions=0, counter=counter, attention_mask=mask)
    T = int(mask.sum())
    assert list(out) == [(0, "expert_fc1_in")]
    assert (counter.used, dict(counter.fallback)) == (T, {"missing": T * DIMS["topk"]})
