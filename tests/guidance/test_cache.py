import dataclasses
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.guidance import shards
from megatron_trace.guidance.cache import GuidanceCache
from megatron_trace.guidance.records import pack_guidance, split_batch
from megatron_trace.guidance.serial import plan_flat
from megatron_trace.guidance.shards import (
    SHARD_VERSION,
    ShardError,
    load_samples,
    read_header,
    shard_index,
    write_shard,
)

from ._data import assert_samples_equal, flat_size, make_batch, step_samples


def test_in_memory_get_returns_identical_samples():
    cache = GuidanceCache(budget_bytes=10**9)
    samples = step_samples(1)
    cache.put(1, samples)
    got = cache.get(1, [103, 101, 999])
    assert got[2] is None
    assert_samples_equal(got[0], samples[3])
    assert_samples_equal(got[1], samples[1])
    # a whole split batch is kept as its columns: exactly the samples' bytes, no per-sample padding
    assert cache.host_bytes == sum(x.nbytes() for x in samples) == cache.peak_host_bytes and cache.disk_bytes == 0
    cache.drop(1)
    assert cache.host_bytes == 0


def _assemble_both(cache, step, samples, ids, tok, mask, versions):
    """cache.assemble(...) == records.assemble(...) on the original samples, fields and counts."""
    from megatron_trace.guidance.records import assemble
    from megatron_trace.guidance.site import FallbackCounter

    from .test_wire import _assert_same_batch

    by_id = {x.sample_id: x for x in samples}
    c1, c2 = FallbackCounter(), FallbackCounter()
    want = assemble([by_id.get(i) for i in ids], tok, versions=versions, counter=c1, attention_mask=mask)
    got = cache.assemble(step, ids, tok, versions=versions, counter=c2, attention_mask=mask)
    _assert_same_batch(want, got)
    assert (c1.used, c1.fallback) == (c2.used, c2.fallback)
    return c2


@pytest.mark.parametrize("path", ["columns", "per_sample", "spilled", "packed", "packed_spilled"])
def test_assemble_equals_records_assemble_on_every_storage_path(tmp_path, path):
    B = 4
    batch, _, tok, mask = make_batch(B=B, seed=3, lengths=[9, 7, 4, 8])
    kw = dict(version=5, attention_mask=mask, sample_ids=[10, 11, 12, 13])
    samples = split_batch(batch, tok, **kw)
    budget = 0 if path.endswith("spilled") else 10**9
    cache = GuidanceCache(budget_bytes=budget, cache_dir=tmp_path)
    if path == "per_sample":  # two puts of part of the split: not a whole batch -> per-sample storage
        cache.put(2, samples[:2])
        cache.put(2, samples[2:])
    elif path.startswith("packed"):  # the columns without per-sample views (the colocated driver)
        packed = pack_guidance(batch, tok, **kw)
        assert packed.guidance_nbytes() == sum(x.guidance_nbytes() for x in samples)
        cache.put(2, packed)
        with pytest.raises(ValueError, match="already has sample id"):
            cache.put(2, pack_guidance(batch, tok, **kw))
    else:
        cache.put(2, samples)
    st = cache._steps[2]
    assert bool(st.packed) == (path in ("columns", "packed")) and bool(st.shards) == path.endswith("spilled")
    ids = [x.sample_id for x in samples]
    assert _assemble_both(cache, 2, samples, ids, tok, mask, 5).coverage == 1.0
    # rows permuted, one sample the step does not have, one from another policy version
    rows = [2, 0, 1, 3]
    t, m = tok[rows], mask[rows]
    c = _assemble_both(cache, 2, samples, [12, 10, 99, 13], t, m, [5, 5, 5, 4])
    assert set(c.fallback) == {"missing", "version"} and c.used > 0
    assert [g.sample_id for g in cache.get(2, [13, 10])] == [13, 10]
    with pytest.raises(KeyError, match="no step 3"):
        cache.assemble(3, ids, tok, versions=5, counter=None, attention_mask=mask)


@pytest.mark.parametrize("path", ["columns", "per_sample", "spilled"])
def test_sample_ids_of_any_integer_type_find_their_samples_on_every_storage_path_and_others_are_refused(tmp_path,
                                                                                                        path):
    """A trainer's row ids as a tensor (0-d elements, hashed by identity) found every sample of a step held as columns
    but none of one spilled or kept per sample (every row counted ``missing``, coverage 0); 10.5 or "10" was served
    sample 10 from columns (``int()``) and nothing from a shard. Every path takes integer ids of any type and refuses
    the rest, naming the value."""
    import numpy as np

    from megatron_trace.guidance.site import FallbackCounter

    from .test_wire import _assert_same_batch

    batch, _, tok, mask = make_batch(B=4, seed=3, lengths=[9, 7, 4, 8])
    ids = [10, 11, 12, 13]
    samples = split_batch(batch, tok, version=5, attention_mask=mask, sample_ids=ids)
    cache = GuidanceCache(budget_bytes=0 if path == "spilled" else 10**9, cache_dir=tmp_path)
    if path == "per_sample":
        cache.put(2, samples[:2])
        cache.put(2, samples[2:])
    else:
        cache.put(2, samples)
    want = _assemble_both(cache, 2, samples, ids, tok, mask, 5)
    ref = cache.assemble(2, ids, tok, versions=5, counter=FallbackCounter(), attention_mask=mask)
    assert want.coverage == 1.0
    for good in (torch.tensor(ids), np.array(ids), [np.int64(10), torch.tensor(11), 12, 13]):
        assert [s.sample_id for s in cache.get(2, good)] == ids
        c = FallbackCounter()
        _assert_same_batch(ref, cache.assemble(2, good, tok, versions=5, counter=c, attention_mask=mask))
        assert (c.used, c.fallback) == (want.used, want.fallback)
    for bad in (10.5, 10.0, "10", True, torch.tensor(10.0)):
        with pytest.raises(ValueError, match=re.escape(f"sample_ids[1]={bad!r} is not an int sample id")):
            cache.get(2, [11, bad])
        with pytest.raises(ValueError, match=re.escape(f"sample_ids[1]={bad!r} is not an int sample id or None")):
            cache.assemble(2, [11, bad, 12, 13], tok, versions=5, counter=FallbackCounter(), attention_mask=mask)


@pytest.mark.parametrize("path", ["columns", "spilled"])
def test_records_of_an_older_or_newer_version_than_the_trainer_expects_are_rejected_and_counted(tmp_path, path):
    """A record is used only under the exact version the trainer recorded for its sample: one from an older policy
    (stale) or from a newer one than the trainer saw (a rollout that moved on) falls back, counted as "version"."""
    batch, _, tok, mask = make_batch(B=4, seed=3, lengths=[9, 7, 4, 8])
    samples = split_batch(batch, tok, version=5, attention_mask=mask, sample_ids=[10, 11, 12, 13])
    cache = GuidanceCache(budget_bytes=0 if path == "spilled" else 10**9, cache_dir=tmp_path)
    cache.put(2, samples)
    ids = [10, 11, 12, 13]
    whole = _assemble_both(cache, 2, samples, ids, tok, mask, 5)
    c = _assemble_both(cache, 2, samples, ids, tok, mask, [4, 6, 5, 5])  # the record newer, then older
    assert set(c.fallback) == {"version"} and 0 < c.fallback["version"] and c.used > 0
    assert c.used + c.fallback["version"] == whole.used
    c = _assemble_both(cache, 2, samples, ids, tok, mask, [6, 6, 6, 6])
    assert c.used == 0 and c.fallback == {"version": whole.used} and c.coverage == 0.0


@pytest.mark.parametrize("fmt,compact", [("nvfp4", True), ("mxfp4", False)])
def test_spill_and_reload_under_tiny_budget_loses_nothing(tmp_path, fmt, compact):
    steps = {s: step_samples(s, fmt=fmt, compact=compact) for s in (1, 2, 3)}
    one = flat_size(steps[1][:1])
    cache = GuidanceCache(budget_bytes=int(2.5 * one), cache_dir=tmp_path)
    for s, samples in steps.items():
        cache.put(s, samples)
    assert cache.peak_host_bytes <= cache.budget_bytes
    assert cache.disk_bytes > 0 and len(list(tmp_path.glob("*.safetensors"))) >= 2
    for s, samples in steps.items():  # micro-batches of 2, in a scrambled order
        ids = [x.sample_id for x in samples]
        for mb in (ids[2:0:-1], [ids[3], ids[0]]):
            for got, sid in zip(cache.get(s, mb), mb):
                assert_samples_equal(got, next(x for x in samples if x.sample_id == sid))
    for s in steps:
        cache.drop(s)
    assert cache.host_bytes == 0 and cache.disk_bytes == 0 and not list(tmp_path.iterdir())
    assert cache.stats()["cache/peak_host_bytes"] == cache.peak_host_bytes > 0


def test_budget_zero_spills_everything_and_several_puts_per_step(tmp_path):
    cache = GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    a, b = step_samples(7)[:2], step_samples(7)[2:]
    cache.put(7, a)
    cache.put(7, b)
    assert cache.peak_host_bytes == 0 and len(list(tmp_path.glob(f"guidance_step00000007_{cache.owner}_part*"))) == 2
    for got, want in zip(cache.get(7, [s.sample_id for s in a + b]), a + b):
        assert_samples_equal(got, want)
    with pytest.raises(ValueError, match="already has sample"):
        cache.put(7, a[:1])


def test_over_budget_without_cache_dir_is_a_clear_error():
    cache = GuidanceCache(budget_bytes=10)
    with pytest.raises(RuntimeError, match="cache_dir"):
        cache.put(0, step_samples(0))


def test_a_put_over_budget_without_cache_dir_keeps_nothing():
    samples = step_samples(0)
    cache = GuidanceCache(budget_bytes=flat_size(samples[:2]))  # two of the four would fit
    with pytest.raises(RuntimeError, match=r"host budget of \d+ bytes \(0 held, this put needs \d+\)"):
        cache.put(0, samples)
    assert cache.host_bytes == 0 and cache.steps == []
    cache.put(0, samples[:2])  # what fits can still be put, once
    assert cache.host_bytes == flat_size(samples[:2])
    with pytest.raises(ValueError, match="already has sample"):
        cache.put(0, samples[:1])


def test_get_sees_every_packed_put_of_a_step():
    batch, _, tok, mask = make_batch(B=2, S=6, layers=(0,), sites=("expert_fc1_in",))
    parts = [pack_guidance(batch, tok, version=3, attention_mask=mask, sample_ids=ids) for ids in ([0, 1], [10, 11])]
    cache = GuidanceCache(budget_bytes=10**9)
    cache.put(7, parts[0])
    assert all(g is not None for g in cache.get(7, [0, 1]))  # builds the step's views
    cache.put(7, parts[1])
    for part in parts:
        ids = list(part.table.ids)
        for got, want in zip(cache.get(7, ids), part.to_samples()):
            assert_samples_equal(got, want)


def test_sample_ids_given_twice_are_named():
    """Within one put and across a step's puts (the check counted each id with ``list.count``: quadratic, 3 s per
    put of 16k samples)."""
    cache = GuidanceCache(budget_bytes=10**9)
    a, b = step_samples(1), step_samples(2)
    twice = [a[0], a[1], dataclasses.replace(b[0], sample_id=a[1].sample_id), b[1]]
    with pytest.raises(ValueError, match=r"step 1 already has sample id\(s\) \[101\]"):
        cache.put(1, twice)
    cache.put(1, a[:2])
    with pytest.raises(ValueError, match=r"step 1 already has sample id\(s\) \[100\]"):
        cache.put(1, [a[0], b[2]])

def test_assemble_sees_a_step_kept_partly_as_columns_partly_per_sample():
    batch, _, tok, mask = make_batch(B=2, S=6, layers=(0,), sites=("expert_fc1_in", "expert_fc2_in"))
    cols = pack_guidance(batch, tok, version=3, attention_mask=mask, sample_ids=[0, 1])
    own = split_batch(batch, tok, version=3, attention_mask=mask, sample_ids=[10, 11])
    cache = GuidanceCache(budget_bytes=10**9)
    cache.put(7, cols)  # kept as columns
    cache.put(7, own[:1])  # parts of a split: per sample
    cache.put(7, own[1:])
    st = cache._steps[7]
    assert st.packed and len(st.chunks) == 2
    rows = [0, 0, 1, 1]
    c = _assemble_both(cache, 7, cols.to_samples() + own, [0, 10, 1, 11], tok[rows], mask[rows], 3)
    assert c.coverage == 1.0 and c.used > 0


def test_a_put_with_one_sample_id_twice_is_refused():
    samples = step_samples(1, B=2)
    cache = GuidanceCache(budget_bytes=10**9)
    with pytest.raises(ValueError, match=r"step 1 already has sample id\(s\) \[100\]"):
        cache.put(1, [samples[0], samples[1], samples[0]])


def test_a_refused_put_leaves_no_empty_step():
    """A put refused for a duplicate id keeps nothing, not even its step: an unknown step stays a KeyError, never a
    step whose every row falls back as ``missing``."""
    samples = step_samples(1, B=2)
    cache = GuidanceCache(budget_bytes=10**9)
    with pytest.raises(ValueError, match="already has sample id"):
        cache.put(1, [samples[0], samples[0]])
    assert cache.steps == [] and cache.host_bytes == 0
    with pytest.raises(KeyError, match="no step 1"):
        cache.get(1, [100])
    cache.put(1, samples)  # the retry is the step's first put
    assert [g.sample_id for g in cache.get(1, [101, 100])] == [101, 100]


def test_unknown_step_and_invalidate(tmp_path):
    cache = GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    cache.put(3, step_samples(3))
    with pytest.raises(KeyError, match=r"no step 4 \(steps held: \[3\]\)"):
        cache.get(4, [0])
    cache.invalidate(3)
    assert cache.steps == [] and not list(tmp_path.iterdir())
    with pytest.raises(KeyError):
        cache.get(3, [300])
    cache.put(3, step_samples(3))  # the step can be redone
    assert cache.get(3, [300])[0] is not None


@pytest.mark.parametrize("budget", [10**9, 0])
@pytest.mark.parametrize("step", [1.5, 1.0, "1", True, None])
def test_a_step_that_is_not_an_int_is_refused_by_every_call(tmp_path, budget, step):
    """Step 1.5 (or "1", True) was kept in memory as step 1 (``int(step)``: a later get(1) served it) and refused with
    a format-code error when the put spilled; every call now names it."""
    samples = step_samples(1, B=2)
    cache = GuidanceCache(budget_bytes=budget, cache_dir=tmp_path)
    want = re.escape(f"step={step!r} is not an int")
    for call in (lambda: cache.put(step, samples), lambda: cache.get(step, [100]), lambda: cache.drop(step),
                 lambda: cache.invalidate(step),
                 lambda: cache.assemble(step, [100], torch.zeros(1, 1, dtype=torch.long), versions=1, counter=None)):
        with pytest.raises(ValueError, match=want):
            call()
    assert cache.steps == [] and cache.host_bytes == cache.disk_bytes == 0 and not list(tmp_path.iterdir())
    import numpy as np

    cache.put(np.int64(1), samples)  # integer types of any kind are the step
    assert cache.steps == [1] and type(cache.steps[0]) is int
    assert [g.sample_id for g in cache.get(torch.tensor(1), [101, 100])] == [101, 100]


@pytest.mark.parametrize("budget", [1.5, float("nan"), True, "10", -1])
def test_a_budget_that_is_not_an_int_of_bytes_is_refused(budget):
    with pytest.raises(ValueError, match=re.escape(f"budget_bytes={budget!r} must be an int >= 0")):
        GuidanceCache(budget_bytes=budget)


def test_from_config(tmp_path):
    cache = GuidanceCache.from_config(TraceConfig(cache_budget_mb=1.5, cache_dir=str(tmp_path / "c")))
    assert cache.budget_bytes == 1.5 * 2**20 and (tmp_path / "c").is_dir()


# ---- shards: crash safety ----------------------------------------------------------------------
def _shard(tmp_path):
    samples = step_samples(2)
    path = tmp_path / "guidance_step00000002_part0000.safetensors"
    size = write_shard(path, samples, step=2)
    assert size == path.stat().st_size and not list(tmp_path.glob("*.tmp*"))
    return path, samples


@pytest.mark.parametrize("bad,match", [
    ("dup_ids", r"write_shard: sample ids \[200\] are given twice"), ("step_bool", "step=True must be an int"),
    ("step_float", "step=1.5 must be an int"), ("load_float", r"sample_ids\[0\]=200.0 is not an int sample id"),
    ("load_bool", r"sample_ids\[0\]=True is not an int sample id"),
    ("load_int", "sample_ids=200 is not a sequence of int sample ids")])
def test_bad_shard_arguments_are_named(tmp_path, bad, match):
    """A repeated sample id's tensors overwrote the earlier sample's (one sample silently lost: the shard read back
    held one of them); a step True / 1.5 was written as its str; a float id (200.0 == 200 in the index) was read as
    a sample that "fails its checksum (corrupt data)", a bare int was a TypeError."""
    path, samples = _shard(tmp_path)
    if bad == "dup_ids":
        samples = [samples[0], dataclasses.replace(samples[1], sample_id=samples[0].sample_id)]
    write = bad.startswith(("dup", "step"))
    step = {"step_bool": True, "step_float": 1.5}.get(bad, 2)
    ids = {"load_float": [200.0], "load_bool": [True], "load_int": 200}.get(bad)
    with pytest.raises(ValueError, match=match):
        if write:
            write_shard(tmp_path / "new.safetensors", samples, step=step)
        else:
            load_samples(path, ids)
    assert not (tmp_path / "new.safetensors").exists()

@pytest.mark.parametrize("keep", [0, 5, 100, -1], ids=["empty", "in-length", "in-header", "last-byte"])
def test_truncated_shard_is_rejected(tmp_path, keep):
    path, samples = _shard(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(ShardError, match="truncated|corrupt header"):
        load_samples(path, [s.sample_id for s in samples])



def test_a_shard_whose_header_disagrees_with_its_own_data_length_is_rejected(tmp_path):
    """The metadata's ``data_nbytes`` (what the writer wrote) must equal the data the tensor table spans: a header
    that lost or gained tensor entries since is rejected, even where the file length fits the table."""
    import re as _re

    path, samples = _shard(tmp_path)
    data = path.read_bytes()
    m = _re.search(rb'"data_nbytes":"(\d+)"', data)
    n = m.group(1)
    wrong = str(int(n) - 1).rjust(len(n), "0").encode() if int(n) > 1 else b"2"  # same length: the file still fits
    path.write_bytes(data[: m.start(1)] + wrong + data[m.end(1):])
    with pytest.raises(ShardError, match=f"metadata data_nbytes={int(wrong)}"):
        read_header(path)

@pytest.mark.parametrize("old,new,match", [
    (rb'"data_offsets":\[', b'"data_offsetS":[', r"tensor \S+'s data end is not an int \(KeyError: 'data_offsets'\)"),
    (rb'"data_offsets":\[0,', b'"data_offsets":[0.', r"tensor \S+'s data end is not an int \(IndexError"),
    (rb'"data_nbytes":"\d', b'"data_nbytes":";', r"metadata data_nbytes is not an int \(ValueError"),
], ids=["key", "one_offset", "nbytes"])
def test_a_damaged_header_entry_is_a_shard_error_naming_it(tmp_path, old, new, match):
    """(Audit, session 59.) One bit flipped in a shard's header (``,`` -> ``.`` merged an entry's offsets into one
    float, a letter of a key or a digit changed; same length) escaped as a bare IndexError / KeyError / ValueError
    from the length check, not the ``ShardError`` naming the file that ``GuidanceCache`` callers handle."""
    path, _ = _shard(tmp_path)
    data = path.read_bytes()
    damaged = re.sub(old, new, data, count=1)
    assert damaged != data and len(damaged) == len(data)
    path.write_bytes(damaged)
    with pytest.raises(ShardError, match=f"guidance shard {re.escape(str(path))}: {match}"):
        shard_index(path)


def test_shard_truncated_after_put_is_rejected_by_get(tmp_path):
    cache = GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    samples = step_samples(5)
    cache.put(5, samples)
    (path,) = tmp_path.glob("*.safetensors")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)  # a half-written data region
    with pytest.raises(ShardError, match=f"{path.name} is truncated or half-written"):
        cache.get(5, [500])


def test_corrupt_shard_bytes_fail_the_checksum(tmp_path):
    path, samples = _shard(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's data
    path.write_bytes(bytes(data))
    index = shard_index(path)
    with pytest.raises(ShardError, match="checksum"):
        load_samples(path, list(index), index)


@pytest.mark.parametrize("field", ["version", "sample_id"])
def test_a_restamped_sample_meta_fails_the_checksum(tmp_path, field):
    """The checksum covers each sample's meta: a header damaged into another valid JSON (a version or id digit
    changed, same length) is refused, not loaded as another sample's or version's guidance."""
    path, samples = _shard(tmp_path)
    data = bytearray(path.read_bytes())
    key = f'\\"{field}\\": '.encode()  # (the metas are a JSON string inside the safetensors JSON header)
    at = data.index(key) + len(key)
    data[at] = ord("7") if data[at] != ord("7") else ord("8")
    path.write_bytes(bytes(data))
    index = shard_index(path)
    with pytest.raises(ShardError, match="fails its checksum"):
        load_samples(path, list(index), index)


def test_a_shard_of_another_shard_version_is_refused(tmp_path):
    path, _ = _shard(tmp_path)
    data = path.read_bytes().replace(f'"shard_version":"{SHARD_VERSION}"'.encode(), b'"shard_version":"0"', 1)
    assert data != path.read_bytes()
    path.write_bytes(data)
    with pytest.raises(ShardError, match="shard_version='0'"):
        shard_index(path)


def test_loads_only_requested_samples(tmp_path):
    path, samples = _shard(tmp_path)
    got = load_samples(path, [samples[2].sample_id])
    assert list(got) == [samples[2].sample_id]
    assert_samples_equal(got[samples[2].sample_id], samples[2])
    header, meta = read_header(path)
    assert meta["step"] == "2" and all(k.split("/")[0].isdigit() for k in header)
    with pytest.raises(KeyError, match="no sample"):
        load_samples(path, [12345])


def test_reloading_spilled_guidance_step_after_step_keeps_no_memory(tmp_path):
    """Every ``get`` of a spilled sample read its tensors with safetensors' ``safe_open(...).get_tensor``, which keeps
    ~64 bytes of process memory per tensor for good: a run reloading its spilled guidance each step grew without
    bound (~80 MiB a step at 4096 spilled samples of 20 guided layers, 4 sites each). The shard reader reads the
    byte ranges itself now, and what it loads is bit-identical to what was written."""
    from tests._rss import rss_status

    path, samples = _shard(tmp_path)
    index = shard_index(path)
    ids = list(index)
    got = load_samples(path, ids, index)
    for s in samples:
        assert_samples_equal(got[s.sample_id], s)
    tensors = len(read_header(path)[0])  # tensors read per load (every sample's)
    del got
    for _ in range(50):  # warm-up: the allocator's own pools
        load_samples(path, ids, index)
    before = rss_status()["VmRSS"]
    loads = 600
    for _ in range(loads):
        load_samples(path, ids, index)
    grown = rss_status()["VmRSS"] - before
    # the leak kept >= 64 bytes per tensor read: loads * tensors * 64 bytes, about 6 MiB here
    assert loads * tensors * 64 > 4 * 2**20 and grown < 2**20, f"RSS grew by {grown} bytes over {loads} reloads"


def test_a_spilled_step_read_back_by_micro_batch_parses_its_shard_header_once(tmp_path):
    """(Audit, session 60.) Every ``get`` from a spilled step read and parsed the shard's whole header (the tensor
    table of every sample) again to load its few samples: a step read back one micro-batch at a time cost samples x
    header bytes, quadratic in its samples (256 samples of 24 guided layers: 0.66 s per get of 4 samples, 0.04 s
    now). A get now reads about its own samples' bytes, and returns them bit-identical."""
    from tests._rss import read_chars

    samples = step_samples(3, B=32, layers=tuple(range(8)))
    cache = GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    cache.put(3, samples)
    (path,) = tmp_path.glob("*.safetensors")
    with open(path, "rb") as f:
        header_bytes = 8 + int.from_bytes(f.read(8), "little")
    cache.get(3, [samples[0].sample_id])  # the first load reads the header
    read = []
    for s in samples[1:]:
        before = read_chars()
        (got,) = cache.get(3, [s.sample_id])
        read.append(read_chars() - before)
        assert_samples_equal(got, s)
    sample_bytes = max(flat_size([s]) for s in samples)
    assert header_bytes > 20 * sample_bytes and max(read) < 4 * sample_bytes, (read, sample_bytes, header_bytes)
    cache.drop(3)  # the kept table goes with its shard
    assert str(path) not in {key[0] for key in shards._TABLES}


def test_not_a_guidance_shard(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(4)}, str(p))
    with pytest.raises(ShardError, match="not a guidance shard"):
        shard_index(p)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_close_deletes_the_spilled_shards_and_a_new_cache_warns_of_old_ones(tmp_path, caplog):
    cache = GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    cache.put(3, step_samples(3))
    cache.put(4, step_samples(4))
    assert len(list(tmp_path.iterdir())) == 2
    GuidanceCache(budget_bytes=0, cache_dir=tmp_path)  # another cache (a rank) of this live run: not warned of
    assert "earlier run" not in caplog.text
    host, pid, _ = cache.owner.rsplit("-", 2)
    write_shard(tmp_path / f"guidance_step00000003_{host}-{_dead_pid()}-0_part0000.safetensors", step_samples(3),
                step=3)  # a finished run's, on this host
    write_shard(tmp_path / "guidance_step00000004_part0000.safetensors", step_samples(4), step=4)  # no owner
    write_shard(tmp_path / f"guidance_step00000005_otherhost-{pid}-0_part0000.safetensors", step_samples(5),
                step=5)  # another host's: it may be running
    GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    assert "holds 2 shard(s)" in caplog.text and "of an earlier run" in caplog.text
    cache.close()
    assert cache.steps == [] and cache.disk_bytes == 0 and len(list(tmp_path.iterdir())) == 3


def test_a_live_caches_shards_of_a_negative_step_are_its_own(tmp_path, caplog):
    """The RL driver keeps its sentinel's records under step -1: their shard name did not parse as owned, so another
    cache starting on the same cache_dir (a rank) took the live cache's shard for an earlier run's and deleted the
    temp file it was writing."""
    live = GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    samples = step_samples(1)
    live.put(-1, samples)
    (path,) = tmp_path.glob("*.safetensors")
    writing = path.with_name(f"{path.name}.tmp{os.getpid()}")
    writing.write_bytes(b"half")  # the live cache writing its next shard
    GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    assert writing.exists() and "earlier run" not in caplog.text and "removed" not in caplog.text
    for got, want in zip(live.get(-1, [s.sample_id for s in samples]), samples, strict=True):
        assert_samples_equal(got, want)


def test_caches_sharing_a_cache_dir_keep_their_own_shards(tmp_path):
    """Every rank built from one TraceConfig gets the same cache_dir: one cache's spill, drop or start must not
    overwrite, delete or clean up another's files."""
    a, b = GuidanceCache(budget_bytes=0, cache_dir=tmp_path), GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    sa, sb = step_samples(1), step_samples(2)
    a.put(0, sa)
    b.put(0, [dataclasses.replace(s, sample_id=s.sample_id - 200 + 100) for s in sb])
    b.drop(0)
    writing = tmp_path / f"guidance_step00000009_{b.owner}_part0000.safetensors.tmp{os.getpid()}"
    writing.write_bytes(b"half")  # a live writer's temp file
    GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    assert writing.exists()
    for got, want in zip(a.get(0, [s.sample_id for s in sa]), sa, strict=True):
        assert_samples_equal(got, want)
    (path,) = tmp_path.glob(f"*{a.owner}*.safetensors")
    path.unlink()  # a user's clean-up, say
    with pytest.raises(ShardError, match="cannot be read .*FileNotFoundError.*deleted or moved by another process"):
        a.get(0, [100])


def test_stale_temp_files_are_removed_on_start(tmp_path):
    stale = [tmp_path / f"guidance_step00000001_part0000.safetensors.tmp{os.getpid()}",  # an older version's
             tmp_path / f"guidance_step00000001_{socket.gethostname()}-{_dead_pid()}-3_part0000.safetensors.tmp1"]
    for p in stale:
        p.write_bytes(b"half")
    GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    assert not any(p.exists() for p in stale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (device staging + pinned host copy)")
def test_cuda_staging_to_pinned_host():
    samples = step_samples(1)
    dev = [s.to("cuda") for s in samples]
    cache = GuidanceCache(budget_bytes=10**9)
    cache.put(1, dev[:2])
    cache.put(1, dev[2:])
    chunk = cache._steps[1].chunks[0]
    assert chunk.buf.is_pinned() and chunk.event is not None
    for got, want in zip(cache.get(1, [s.sample_id for s in samples]), samples):
        assert_samples_equal(got, want)


def test_split_samples_restamped_after_the_split_are_kept_under_their_own_ids_and_versions():
    """A split batch's samples given new ids / versions (``dataclasses.replace``) are no longer the columns' table:
    the cache keeps and serves them under what they say, as ``records.assemble`` would read them."""
    import dataclasses

    from megatron_trace.guidance.records import assemble
    from megatron_trace.guidance.site import FallbackCounter

    batch, _, tok, mask = make_batch(B=3, S=9, layers=(0,), sites=("expert_fc1_in",))
    stamped = [dataclasses.replace(s, sample_id=100 + s.sample_id, version=4)
               for s in split_batch(batch, tok, version=1, attention_mask=mask)]
    cache = GuidanceCache(budget_bytes=10**9)
    cache.put(0, stamped)
    assert cache.get(0, [0, 1, 2]) == [None] * 3
    for got, want in zip(cache.get(0, [100, 101, 102]), stamped):
        assert (got.sample_id, got.version) == (want.sample_id, 4)
        assert_samples_equal(got, want)
    counts = []
    for assembled in (lambda c: cache.assemble(0, [100, 101, 102], tok, versions=4, counter=c, attention_mask=mask),
                      lambda c: assemble(stamped, tok, versions=4, counter=c, attention_mask=mask)):
        c = FallbackCounter()
        assembled(c)
        counts.append(c.as_dict())
    assert counts[0] == counts[1] and counts[0]["guidance/coverage"] == 1.0


@pytest.mark.parametrize("path", ["columns", "per_sample", "spilled", "packed", "packed_spilled", "no_records"])
def test_samples_of_no_tokens_and_layers_without_records_on_every_storage_path(tmp_path, path):
    """Guided layer 1 recorded nothing (absent from the rollout batch), samples 11 and 13 have no tokens, and
    ("no_records") samples with no record at all: kept, returned and assembled like ``records.assemble``, rows
    without a record counted ``missing``; nothing fails on empty tensors or is dropped."""
    from megatron_trace.guidance.records import SampleGuidance

    batch, _, tok, mask = make_batch(B=4, S=6, lengths=[6, 0, 5, 0], layers=(0, 1),
                                     sites=("expert_fc1_in", "expert_fc2_in"))
    layer0 = {k: v for k, v in batch.items() if k[0] == 0}
    kw = dict(version=2, attention_mask=mask, sample_ids=[10, 11, 12, 13])
    samples = split_batch(layer0, tok, **kw)
    cache = GuidanceCache(budget_bytes=0 if path.endswith("spilled") else 10**9, cache_dir=tmp_path)
    if path == "per_sample":
        cache.put(1, samples[:1])
        cache.put(1, samples[1:])
    elif path.startswith("packed"):
        cache.put(1, pack_guidance(layer0, tok, **kw))
    elif path == "no_records":  # per sample, none of them with a site
        samples = [SampleGuidance(x.sample_id, x.version, x.token_hash, x.num_tokens, {}) for x in samples]
        samples[0] = split_batch(layer0, tok, **kw)[0]  # one sample with its records
        cache.put(1, samples)
    else:
        cache.put(1, samples)
    assert [x.sample_id for x in cache.get(1, [11, 13, 10])] == [11, 13, 10]
    assert [x.num_tokens for x in cache.get(1, [11, 13])] == [0, 0]
    c = _assemble_both(cache, 1, samples, [10, 11, 12, 13], tok, mask, 2)
    T = 6 + 5  # tokens of samples 10 and 12; the rows of layer 0: FC1 one per token, FC2 one per top-3 expert
    assert (c.used, dict(c.fallback)) == ((6 * 4, {"missing": 5 * 4}) if path == "no_records" else (T * 4, {}))
    c = _assemble_both(cache, 1, samples, [11, 13], tok[[1, 3]], mask[[1, 3]], 2)  # only the empty samples
    assert (c.used, dict(c.fallback)) == (0, {})


def test_a_put_whose_spill_fails_keeps_nothing_and_a_retry_is_not_shadowed(tmp_path):
    """The samples that fit were kept in memory although the put raised (its spill failed: the disk went away),
    unlisted but found first by get: a retry of the step with a new rollout had them shadow its own samples (144 of
    252 rows rejected as token_hash) and host_bytes counted them twice."""
    import shutil

    from megatron_trace.guidance.records import SampleGuidance
    from megatron_trace.guidance.site import FallbackCounter

    def rollout(seed):
        batch, _, tok, mask = make_batch(B=4, S=6, lengths=[6, 6, 5, 4], seed=seed)
        samples = split_batch(batch, tok, version=1, attention_mask=mask, sample_ids=[10, 11, 12, 13])
        # per-sample storage: two fit the budget, two are spilled
        return [SampleGuidance(x.sample_id, x.version, x.token_hash, x.num_tokens, dict(x.sites)) for x in samples], \
            tok, mask

    first, _, _ = rollout(0)
    cache = GuidanceCache(budget_bytes=2 * plan_flat(first[:1]).total, cache_dir=tmp_path / "c")
    shutil.rmtree(tmp_path / "c")
    with pytest.raises(Exception, match="No such file or directory"):
        cache.put(0, first)
    assert cache.steps == [] and cache.host_bytes == 0
    (tmp_path / "c").mkdir()
    again, tok, mask = rollout(5)
    cache.put(0, again)
    c = FallbackCounter()
    cache.assemble(0, [10, 11, 12, 13], tok, versions=1, counter=c, attention_mask=mask)
    assert (c.used, dict(c.fallback)) == (252, {})
    assert cache.host_bytes == plan_flat(again[:2]).total


def test_a_whole_batch_kept_as_columns_counts_what_the_cache_already_holds():
    """Budget for one batch: the first is kept as columns, the second (a whole split batch too) must spill, not be
    kept beside it at twice the budget."""
    b1, b2 = step_samples(1), step_samples(2)
    one = sum(x.nbytes() for x in b1)
    cache = GuidanceCache(budget_bytes=one + 8, cache_dir=None)
    cache.put(1, b1)
    assert cache.host_bytes == one
    with pytest.raises(RuntimeError, match="exceeds the host budget"):  # no cache_dir: a clear error, nothing kept
        cache.put(2, b2)
    assert cache.steps == [1] and cache.host_bytes == one


def test_a_whole_batch_over_what_is_left_spills_and_reads_back(tmp_path):
    b1, b2 = step_samples(1), step_samples(2)
    cache = GuidanceCache(budget_bytes=sum(x.nbytes() for x in b1) + 8, cache_dir=tmp_path)
    cache.put(1, b1)
    cache.put(2, b2)
    assert cache.peak_host_bytes <= cache.budget_bytes and cache.disk_bytes > 0
    for got, want in zip(cache.get(2, [x.sample_id for x in b2]), b2):
        assert_samples_equal(got, want)


def test_peak_host_bytes_is_the_high_water_mark():
    big, small = step_samples(1), step_samples(2)[:1]
    cache = GuidanceCache(budget_bytes=10**9)
    cache.put(1, big)
    high = cache.host_bytes
    cache.drop(1)
    cache.put(2, small)
    assert cache.host_bytes == flat_size(small) < high == cache.peak_host_bytes


def test_steps_that_reuse_sample_ids_read_back_their_own_spilled_samples(tmp_path):
    """Sample ids restart every step (0..B-1): each step's shard holds its own samples, never another step's."""
    def batch(step):
        b, _, tok, mask = make_batch(B=3, seed=step)
        return split_batch(b, tok, version=step, attention_mask=mask, sample_ids=[0, 1, 2])

    steps = {s: batch(s) for s in (1, 2)}
    cache = GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    for s, samples in steps.items():
        cache.put(s, samples)
    for s, samples in steps.items():
        for got, want in zip(cache.get(s, [2, 0, 1]), [samples[2], samples[0], samples[1]]):
            assert got.version == s
            assert_samples_equal(got, want)
    cache.drop(1)
    assert [g.version for g in cache.get(2, [0, 1, 2])] == [2, 2, 2] and cache.steps == [2]


def test_dropping_a_step_whose_shard_is_already_gone_uncounts_its_bytes(tmp_path):
    """A shard deleted behind the cache's back (a tmp cleaner, an operator) stayed in disk_bytes for good after its
    step was dropped: the drop subtracted the size of the files it still found."""
    cache = GuidanceCache(budget_bytes=0, cache_dir=tmp_path)
    cache.put(1, step_samples(1)[:2])
    cache.put(1, step_samples(1)[2:])
    cache.put(2, step_samples(2))
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) == 3 and cache.disk_bytes == sum(p.stat().st_size for p in shards)
    step2 = cache.disk_bytes - shards[0].stat().st_size - shards[1].stat().st_size
    shards[0].unlink()
    cache.drop(1)
    assert cache.disk_bytes == step2 and sorted(tmp_path.glob("*.safetensors")) == shards[2:]
    cache.drop(2)
    assert cache.disk_bytes == 0 and not list(tmp_path.iterdir())


def test_a_cache_dir_that_is_a_file_is_named(tmp_path):
    """It was mkdir's bare "[Errno 17] File exists"."""
    f = tmp_path / "shards"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=re.escape(f"cache_dir={str(f)!r} is a file: give a directory")):
        GuidanceCache(10, f)
