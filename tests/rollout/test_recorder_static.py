"""The recorder's static store (``rollout.recorder_static``): each step's values written at the device step index,
read back as the concatenation of the steps, forked with the batch, and named errors for what does not fit."""

import pytest
import torch

from megatron_trace.formats import Quantizer
from megatron_trace.rollout.recorder import GuidanceRecorder, cat_records, map_record
from megatron_trace.rollout.recorder_static import StaticSteps


def _step_record(b: int, gen: torch.Generator):
    """A compact NVFP4 record of one step, batch-major [B, 1, 32] (per-row amax)."""
    q = Quantizer("nvfp4", per_row=True).quantize(torch.randn(b, 32, generator=gen))
    rec = q.guidance(compact=True)
    return map_record(rec, lambda t: t.reshape(b, 1, *t.shape[1:]), (b, 1, 32))


def test_steps_read_back_as_their_concatenation_and_fork_with_the_batch():
    gen = torch.Generator().manual_seed(0)
    store = StaticSteps(4, torch.device("cpu"))
    steps = [_step_record(3, gen) for _ in range(3)]
    ids = [torch.randint(0, 8, (3, 2), generator=gen) for _ in range(3)]
    for i, (rec, idx) in enumerate(zip(steps, ids, strict=True)):
        store.index.fill_(i)
        store.put("site", rec)
        store.put("routing", idx[:, None])
        store.count += 1
    got, want = store.view("site"), cat_records(steps, 1)
    assert got.shape == want.shape == (3, 3, 32)
    assert torch.equal(got.mantissa_bits, want.mantissa_bits)
    assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    assert torch.equal(got.global_amax, want.global_amax)
    assert torch.equal(store.view("routing"), torch.stack(ids, 1))
    assert store.chunks("absent") == []
    fork = torch.tensor([2, 2, 0])
    store.select(fork)
    assert torch.equal(store.view("routing"), torch.stack(ids, 1)[fork])
    assert torch.equal(store.view("site").mantissa_bits, want.mantissa_bits[fork])


def test_a_rewritten_step_replaces_the_earlier_write():
    """A CUDA-graph capture writes the next step once before the step itself runs: the step's write wins."""
    store = StaticSteps(2, torch.device("cpu"))
    store.put("routing", torch.full((2, 1, 2), 7))
    store.put("routing", torch.full((2, 1, 2), 3))  # the same index
    store.count = 1
    assert torch.equal(store.view("routing"), torch.full((2, 1, 2), 3))


def test_static_store_errors_name_what_does_not_fit():
    store = StaticSteps(2, torch.device("cpu"))
    store.put("routing", torch.zeros(2, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"a step of \[2, 3, ...\] rows, the buffer holds \[2, 1 per step"):
        store.put("routing", torch.zeros(2, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="steps=0 must be an int >= 1"):
        StaticSteps(0, torch.device("cpu"))
    rec = GuidanceRecorder(2, set(), compact=True)
    rec.begin_static(1, torch.device("cpu"))
    with pytest.raises(ValueError, match="already called"):
        rec.begin_static(1, torch.device("cpu"))
    rec.end_step(torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="more than the 1 static steps"):
        rec.end_step(torch.ones(2, 1, dtype=torch.bool))


def test_forked_rows_keep_their_records_shape():
    """``select`` (``GuidanceRecorder.select_rows`` after ``begin_static``) with another batch size: the records kept
    the old batch in their ``shape`` (views of 3 rows said 2), and the next step's write was refused."""
    from megatron_trace.config import TraceConfig

    quantizer = TraceConfig().activation_quantizer()
    rec = lambda b: quantizer.quantize(torch.randn(b, 1, 64)).guidance(compact=True)  # noqa: E731
    store = StaticSteps(2, torch.device("cpu"))
    store.put("fc1", rec(2))
    store.count = 1
    store.select(torch.tensor([0, 0, 1]))
    store.index.fill_(1)
    store.put("fc1", rec(3))
    store.count = 2
    view = store.view("fc1")
    assert view.shape == (3, 2, 64) and view.mantissa_bits.shape == (3, 2, 8)


def test_a_kv_site_is_recorded_per_step_or_from_its_store_never_both():
    """A K/V site with per-step records (SGLang's KV format) refuses a stored history too: ``finish`` would take
    the history alone and drop the steps' records without a word."""
    q = Quantizer("nvfp4", per_row=True).quantize(torch.randn(2, 1, 3, 16, generator=torch.Generator().manual_seed(1)))
    rec = GuidanceRecorder(2, {(0, "kv_k"), (1, "kv_k")}, compact=True)
    rec.add_heads_major(0, "kv_k", q)
    with pytest.raises(ValueError, match=r"site \(0, 'kv_k'\) already has per-step records; it cannot also be "
                                         r"recorded from a history"):
        rec.add_kv_history(0, "kv_k", lambda: q)
    rec.add_kv_history(1, "kv_k", lambda: q)  # a site without per-step records takes its store
    rec.add_kv_history(2, "kv_k", lambda: q)  # a site not recorded: nothing kept
    rec.end_step(torch.ones(2, 3, dtype=torch.bool))  # the 3 positions' forward
    assert rec.site_records((1, "kv_k"))[0].shape == (2, 3, 1, 16) and (2, "kv_k") not in rec._histories


def test_steps_of_several_rows_land_at_their_step_times_the_rows():
    """Values of n = 2 rows per step (a prefill-sized or multi-token step), written out of step order: step i holds
    rows 2i, 2i + 1 in their order, and a view holds the ``count`` steps so far, no more."""
    gen = torch.Generator().manual_seed(2)
    steps = [torch.randint(0, 100, (2, 2, 3), generator=gen) for _ in range(3)]
    recs = [_step_record(2, gen) for _ in range(3)]
    recs = [cat_records([r, _step_record(2, gen)], 1) for r in recs]  # [2, 2, 32]: two rows per step
    store = StaticSteps(3, torch.device("cpu"))
    for i in (2, 0, 1):
        store.index.fill_(i)
        store.put("routing", steps[i])
        store.put("site", recs[i])
        store.put("one", steps[i][:, :1])  # another key of one row per step
    store.count = 2
    assert torch.equal(store.view("routing"), torch.cat(steps[:2], 1))
    store.count = 3
    assert torch.equal(store.view("routing"), torch.cat(steps, 1))
    assert torch.equal(store.view("one"), torch.cat([s[:, :1] for s in steps], 1))
    got, want = store.view("site"), cat_records(recs, 1)
    assert got.shape == want.shape == (2, 6, 32)
    assert torch.equal(got.mantissa_bits, want.mantissa_bits) and torch.equal(got.global_amax, want.global_amax)
    assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    with pytest.raises(ValueError, match=r"routing: a step of \[3, 2, ...\] rows, the buffer holds \[2, 2 per step"):
        store.put("routing", torch.zeros(3, 2, 3, dtype=torch.long))
