"""Refusals leave no half-applied state: a call that raises keeps, counts and stores nothing of itself, so a retry
computes what a first call would."""

import dataclasses

import numpy as np
import pytest
import torch

from megatron_trace.guidance.cache import GuidanceCache
from megatron_trace.guidance.packed_assemble import assemble_packed
from megatron_trace.guidance.records import SampleGuidance, assemble, pack_guidance, split_batch
from megatron_trace.guidance.site import FallbackCounter

from ._data import DIMS, assert_samples_equal, flat_size, make_batch, step_samples


def test_a_put_refused_for_a_bad_sample_leaves_no_step_and_no_bytes():
    """A sample whose site is not a SiteRecord failed in the serialisation after the put had made its step: the step
    stayed, empty (``steps`` [1], ``get`` gave None, so every row would fall back as ``missing``, not KeyError)."""
    samples = step_samples(1, B=2)
    good = [SampleGuidance(s.sample_id, s.version, s.token_hash, s.num_tokens, dict(s.sites)) for s in samples]
    key = next(iter(good[1].sites))
    bad = dataclasses.replace(good[1], sites={**good[1].sites, key: "not a record"})
    cache = GuidanceCache(budget_bytes=10**9)
    with pytest.raises(TypeError, match=rf"sample 101 site \(0, '{key[1]}'\) must be a SiteRecord, got str"):
        cache.put(1, [good[0], bad])
    assert cache.steps == [] and cache.stats()["cache/host_bytes"] == 0 and cache.stats()["cache/steps"] == 0
    with pytest.raises(KeyError, match="no step 1"):
        cache.get(1, [100])
    cache.put(1, good[:1])  # a refused second put of a step keeps the first one's samples as they were
    with pytest.raises(TypeError, match="must be a SiteRecord"):
        cache.put(1, [bad])
    assert cache.steps == [1] and cache.host_bytes == flat_size(good[:1])
    assert_samples_equal(cache.get(1, [100, 101])[0], good[0])
    assert cache.get(1, [101]) == [None]
    cache.put(1, good[1:])
    assert_samples_equal(cache.get(1, [101])[0], good[1])


@pytest.mark.parametrize("packed", [False, True], ids=["samples", "columns"])
def test_an_assembly_that_raises_half_way_counts_nothing_and_its_retry_counts_once(packed):
    """The FC1 keys were counted into the caller's counter before an FC2 key without records (and no ``topk``)
    raised: the retry with ``topk`` counted them twice (used 2T where one assembly counts T)."""
    batch, _, tok, mask = make_batch(B=2, lengths=[9, 7], layers=(0,), sites=("expert_fc1_in",))
    T, k = int(mask.sum()), DIMS["topk"]
    keys = [(0, "expert_fc1_in"), (0, "expert_fc2_in")]

    def run(counter, **kw):
        if packed:
            p = pack_guidance(batch, tok, version=0, attention_mask=mask)
            return assemble_packed([p], [0, 1], tok, versions=0, counter=counter, attention_mask=mask, keys=keys, **kw)
        samples = split_batch(batch, tok, version=0, attention_mask=mask)
        return assemble(samples, tok, versions=0, counter=counter, attention_mask=mask, keys=keys, **kw)

    shared, fresh = FallbackCounter(), FallbackCounter()
    with pytest.raises(ValueError, match=r"guided key \(0, 'expert_fc2_in'\) .* pass topk="):
        run(shared)
    assert (shared.used, dict(shared.fallback)) == (0, {})
    run(shared, topk=k)
    run(fresh, topk=k)
    assert (shared.used, dict(shared.fallback)) == (fresh.used, dict(fresh.fallback)) == (T, {"missing": T * k})
    with pytest.raises(TypeError, match="counter must be a FallbackCounter, got dict"):
        run({}, topk=k)


def test_a_shard_that_cannot_be_deleted_is_named_and_the_others_are_still_deleted(tmp_path):
    """drop stopped at the first shard it could not delete: the step was already forgotten, so its later shards stayed
    on disk unnamed and uncounted, and close() stopped there too, leaving the later steps held."""
    d = tmp_path / "c"
    cache = GuidanceCache(budget_bytes=0, cache_dir=d)
    for step in (0, 1):
        samples = step_samples(step + 1, B=2)
        cache.put(step, samples[:1])
        cache.put(step, samples[1:])  # two shards per step
    assert cache.steps == [0, 1] and len(list(d.glob("*.safetensors"))) == 4
    first = sorted(d.glob("guidance_step00000000_*_part0000.safetensors"))[0]
    first.unlink()
    first.mkdir()  # (an entry that unlink refuses: root ignores a read-only directory)
    (first / "x").touch()
    with pytest.raises(OSError, match=rf"guidance step 0 was dropped, but 1 of its spilled shard\(s\) could not be "
                                      rf"deleted .*{first.name}"):
        cache.close()
    assert cache.steps == [] and cache.disk_bytes == 0 and cache.host_bytes == 0
    assert [p.name for p in d.iterdir()] == [first.name]  # the other step-0 shard and step 1's are gone


@pytest.mark.parametrize("packed", [False, True], ids=["samples", "columns"])
def test_guided_keys_are_distinct_layer_site_pairs(packed):
    """``keys`` was taken as given: a key named twice was assembled and counted twice (used 2T for T tokens), a
    misspelt site counted every token ``missing`` (coverage 0, no error), and a [layer, site] list failed as
    'unhashable type: list'. A layer given as a 0-d tensor or a NumPy int is the int layer (a tensor hashes by
    identity: kept as given, it matched no record and counted every token ``missing``)."""
    batch, _, tok, mask = make_batch(B=2, lengths=[9, 7], layers=(0,), sites=("expert_fc1_in",))
    T, key = int(mask.sum()), (0, "expert_fc1_in")

    def run(keys):
        counter = FallbackCounter()
        if packed:
            p = pack_guidance(batch, tok, version=0, attention_mask=mask)
            out = assemble_packed([p], [0, 1], tok, versions=0, counter=counter, attention_mask=mask, keys=keys)
        else:
            samples = split_batch(batch, tok, version=0, attention_mask=mask)
            out = assemble(samples, tok, versions=0, counter=counter, attention_mask=mask, keys=keys)
        return list(out), (counter.used, dict(counter.fallback))

    assert run([key]) == run([[0, "expert_fc1_in"]]) == ([key], (T, {}))
    for layer in (torch.tensor(0), np.int64(0)):
        out, counts = run([(layer, "expert_fc1_in")])
        assert (out, counts) == ([key], (T, {})) and type(out[0][0]) is int
    for keys, match in (([key, key], r"keys name \[\(0, 'expert_fc1_in'\)\] more than once"),
                        ([(0, "expert_fc1")], r"keys: \(0, 'expert_fc1'\) is not a \(layer, site\) key"),
                        ([(-1, "kv_k")], r"keys: \(-1, 'kv_k'\) is not a \(layer, site\) key"),
                        ([(0.5, "kv_k")], r"is not a \(layer, site\) key"),
                        (key, r"is one key: give a list")):
        with pytest.raises(ValueError, match=match):
            run(keys)
