"""Assembling a micro-batch's guidance straight into a packed row (``layout=PackedLayout``) against assembling it
batch-major and moving it with ``megatron.packing.pack_step``: the same tensors, bit for bit, and the same counts,
on every storage path (columns, flat per-sample buffers, spilled shards, a sync's received shard)."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.guidance.cache import GuidanceCache
from megatron_trace.guidance.layout import PackedLayout
from megatron_trace.guidance.packed import pack_routing
from megatron_trace.guidance.records import pack_guidance, payload_of, split_batch
from megatron_trace.guidance.routing import assemble_routing, split_routing
from megatron_trace.guidance.site import FallbackCounter
from megatron_trace.guidance.transfer import GuidanceShard
from megatron_trace.megatron import StepGuidance, pack_step, packed_layout

from ._data import DIMS, make_batch

B, S = 4, 9
LENGTHS = [9, 0, 5, 7]
ORDER = [2, 0, 3, 1]  # the trainer's rows: rollout samples in another order
CU = [0, 8, 24, 32, 32]  # the trainer rows' segments (5, 9, 7 and 0 tokens, padded to a multiple of 8)
TOTAL = 35  # tail padding


def _data(left_pad: bool):
    batch, _, tokens, mask = make_batch(B, S, lengths=LENGTHS, left_pad=left_pad, fmt="nvfp4")
    routing = {layer: torch.randint(0, DIMS["experts"], (B, S, DIMS["topk"]), generator=torch.Generator()
                                    .manual_seed(layer)) * mask[..., None] for layer in (1, 3)}
    t_tokens, t_mask = tokens[ORDER].clone(), mask[ORDER]
    t_tokens[2, t_mask[2].nonzero()[0, 0]] += 1  # row 2 (sample 3): other tokens than recorded (token_hash)
    return batch, routing, tokens, mask, t_tokens, t_mask


def _assemblers(path: str, batch, routing, tokens, mask, tmp_path):
    """(assemble(layout=...), assemble_routing(layout=...)) over trainer rows ``ORDER``, from ``path``'s storage."""
    ids = list(ORDER)
    if path == "shard":
        shard = GuidanceShard()
        shard.parts = [pack_guidance(batch, tokens, version=0, attention_mask=mask)]
        shard.routing_parts = [pack_routing(routing, tokens, mask, [0] * B, list(range(B)), torch.uint8)]
        return (lambda tt, tm, c, **kw: shard.assemble(ids, tt, versions=[0, 1, 0, 0], counter=c, attention_mask=tm,
                                                       **kw),
                lambda tt, tm, **kw: shard.assemble_routing(ids, tt, versions=0, attention_mask=tm, **kw))
    if path == "columns":
        cache = GuidanceCache(1 << 30)
        cache.put(0, pack_guidance(batch, tokens, version=0, attention_mask=mask))
    else:  # flat per-sample buffers (two puts), or every sample spilled to a shard
        cache = GuidanceCache(1 << 30) if path == "samples" else GuidanceCache(0, cache_dir=tmp_path)
        samples = split_batch(batch, tokens, version=0, attention_mask=mask)
        cache.put(0, samples[:2])
        cache.put(0, samples[2:])
    sroute = split_routing(routing, tokens, version=0, num_experts=DIMS["experts"], attention_mask=mask)
    return (lambda tt, tm, c, **kw: cache.assemble(0, ids, tt, versions=[0, 1, 0, 0], counter=c, attention_mask=tm,
                                                   **kw),
            lambda tt, tm, **kw: assemble_routing([sroute[i] for i in ids], tt, versions=0, attention_mask=tm, **kw))


def _fields(sg) -> list:
    r = sg.record
    return [payload_of(r), r.block_scales.view(torch.uint8), r.global_amax, sg.valid, sg.expert_ids]


@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("path", ["columns", "samples", "spill", "shard"])
def test_assembling_into_the_packed_row_equals_packing_the_padded_assembly(path, left_pad, tmp_path):
    batch, routing, tokens, mask, t_tokens, t_mask = _data(left_pad)
    guid, route = _assemblers(path, batch, routing, tokens, mask, tmp_path)
    want_counter, got_counter = FallbackCounter(), FallbackCounter()
    padded = StepGuidance(sites=guid(t_tokens, t_mask, want_counter), routing={}, token_mask=t_mask)
    want = pack_step(padded, CU, total=TOTAL)
    layout = packed_layout(CU, total=TOTAL)
    got = guid(t_tokens, t_mask, got_counter, layout=layout)
    assert want_counter == got_counter and got_counter.fallback["token_hash"] and got_counter.fallback["version"]
    assert want.sites.keys() == got.keys() and got
    for key, sg in got.items():
        w = want.sites[key]
        assert sg.record.shape == w.record.shape == (1, TOTAL, *w.record.shape[2:]), key
        assert type(sg.record) is type(w.record) and sg.scales_checked == w.scales_checked, key
        for a, b in zip(_fields(sg), _fields(w)):
            assert (a is None and b is None) or torch.equal(a, b), key
    assert torch.equal(layout.token_mask(t_mask), want.token_mask)
    # routing: the batch's own tokens (a token_hash mismatch is an error there, not a fallback)
    r_tokens, r_mask = tokens[ORDER], mask[ORDER]
    want_r = pack_step(StepGuidance(routing=route(r_tokens, r_mask), token_mask=r_mask), CU, total=TOTAL).routing
    got_r = route(r_tokens, r_mask, layout=layout)
    assert want_r.keys() == got_r.keys() == {1, 3}
    assert all(torch.equal(got_r[k], want_r[k]) and got_r[k].shape == (1, TOTAL, DIMS["topk"]) for k in got_r)


def test_the_packed_rows_hold_each_sample_at_its_segment():
    """An independent placement: sample b's i-th token's record row sits at packed position CU[b] + i; every other
    position is zero and invalid."""
    batch, routing, tokens, mask, _, _ = _data(left_pad=True)
    t_tokens, t_mask = tokens[ORDER], mask[ORDER]
    shard = GuidanceShard()
    shard.parts = [pack_guidance(batch, tokens, version=0, attention_mask=mask)]
    counter = FallbackCounter()
    got = shard.assemble(list(ORDER), t_tokens, versions=0, counter=counter, attention_mask=t_mask,
                         layout=PackedLayout.of(CU, total=TOTAL))
    for key, sg in got.items():
        src, taken = batch[key], torch.zeros(TOTAL, dtype=torch.bool)
        for b, sample in enumerate(ORDER):
            pos = mask[sample].nonzero().squeeze(1)
            at = torch.arange(len(pos)) + CU[b]
            taken[at] = True
            assert torch.equal(payload_of(sg.record)[0, at], payload_of(src.record)[sample, pos]), key
            assert torch.equal(sg.valid[0, at], src.valid[sample, pos]), key
        assert not bool(payload_of(sg.record)[0, ~taken].any()) and not bool(sg.valid[0, ~taken].any()), key
    assert counter.fallback == {} and counter.used == sum(int(v.valid.sum()) for v in batch.values())


@pytest.mark.parametrize("path", ["columns", "samples", "shard"])
@pytest.mark.parametrize("cu,total,match", [
    ([0, 8, 24, 32], None, r"cu_seqlens has 4 entries, the micro-batch has B=4 samples: need B \+ 1 = 5"),
    ([0, 4, 24, 32, 32], None, r"sample 0 has 5 tokens, longer than its segment cu_seqlens\[0:2\]=\[0, 4\]"),
    ([0, 8, 24, 32, 32], 31, r"total=31 must be an int >= cu_seqlens\[-1\]=32"),
], ids=["rows", "short-segment", "total"])
def test_a_layout_that_does_not_fit_is_refused_before_anything_is_counted(path, cu, total, match, tmp_path):
    batch, routing, tokens, mask, t_tokens, t_mask = _data(left_pad=False)
    guid, route = _assemblers(path, batch, routing, tokens, mask, tmp_path)
    counter = FallbackCounter()
    with pytest.raises(ValueError, match=match):
        guid(t_tokens, t_mask, counter, layout=PackedLayout.of(cu, total=total))
    assert counter == FallbackCounter()
    if total is None:
        with pytest.raises(ValueError, match=match):
            route(tokens[ORDER], mask[ORDER], layout=PackedLayout.of(cu))


def test_packed_layout_reads_the_samples_lengths_from_packed_seq_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 14, 21, 21], dtype=torch.int32),
                          cu_seqlens_q_padded=torch.tensor(CU, dtype=torch.int32))
    layout = packed_layout(psp, total=TOTAL)
    assert layout == PackedLayout(tuple(CU), TOTAL, (5, 9, 7, 0))
    layout.check(mask := torch.arange(S)[None] < torch.tensor([5, 9, 7, 0])[:, None])
    mask[2, 6] = False
    with pytest.raises(ValueError, match=r"sample 2 has 6 tokens in its token_mask row, but the PackedSeqParams "
                                         r"holds 7"):
        layout.check(mask)
    same = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(CU), cu_seqlens_q_padded=torch.tensor(CU))
    assert packed_layout(same) == PackedLayout(tuple(CU), CU[-1], None)
    with pytest.raises(ValueError, match=r"cu_seqlens_q has 4 entries, cu_seqlens_q_padded 5"):
        packed_layout(PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 14, 21]),
                                      cu_seqlens_q_padded=torch.tensor(CU)))


@pytest.mark.parametrize("build,match", [
    (lambda: PackedLayout((0, 8, 24, 32, 32), 31), r"total=31 must be an int >= cu_seqlens\[-1\]=32"),
    (lambda: PackedLayout((2, 8, 24, 32, 32), TOTAL), r"cu_seqlens must start at 0, got 2"),
    (lambda: PackedLayout((0, 24, 8, 32, 32), TOTAL), r"cu_seqlens must not decrease: cu_seqlens\[2\]=8"),
    (lambda: PackedLayout((0, 8, 7, 32, 32), TOTAL), r"cu_seqlens must not decrease: cu_seqlens\[2\]=7 < "),
    (lambda: PackedLayout.of(CU, lengths=[5, 9, 7.5, 0]), r"lengths must be ints >= 0 .*got 7.5"),
    (lambda: PackedLayout.of(CU, lengths=[5, 9, -1, 0]), r"lengths must be ints >= 0 .*got -1"),
    (lambda: PackedLayout(tuple(CU), TOTAL, (5, 9, 7)), r"3 sample lengths for 4 segments"),
    (lambda: PackedLayout.of(CU, lengths=7), r"lengths must be B ints .*got 7"),
], ids=["total", "start", "decrease", "decrease-by-one", "float-length", "negative-length", "lengths", "one-length"])
def test_a_layout_is_checked_however_it_is_built(build, match):
    """``PackedLayout(...)`` itself (as the dataclass it is) checks what ``of`` checks: a row shorter than its last
    segment was an IndexError in the middle of the assembly, a sample's segment not from 0 moved every token, a
    length 7.5 was 7 tokens."""
    with pytest.raises(ValueError, match=match):
        build()


def test_packed_seq_params_given_where_a_layout_is_taken_are_refused_by_name(tmp_path):
    from megatron.core.packed_seq_params import PackedSeqParams

    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(CU, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"a PackedSeqParams gives its layout through megatron.packed_layout"):
        PackedLayout.of(psp)
    batch, routing, tokens, mask, t_tokens, t_mask = _data(left_pad=False)
    for path in ("columns", "samples", "shard"):
        guid, route = _assemblers(path, batch, routing, tokens, mask, tmp_path)
        counter = FallbackCounter()
        with pytest.raises(TypeError, match=r"layout= takes a guidance.layout.PackedLayout .*got PackedSeqParams"):
            guid(t_tokens, t_mask, counter, layout=psp)  # (was AttributeError: no attribute 'check' / 'total')
        assert counter == FallbackCounter()
        with pytest.raises(TypeError, match=r"layout= takes a guidance.layout.PackedLayout .*got list"):
            route(tokens[ORDER], mask[ORDER], layout=CU)


def test_an_attention_mask_places_tokens_as_the_assembly_reads_it(tmp_path):
    """The assembly reads an attention mask's nonzero entries as tokens (``records.token_mask``); the layout's
    ``token_mask`` of that same mask (README's ``layout.token_mask(mb_mask)``) must mark the positions it filled.
    A 2 in an int mask was refused (its row's sum), a 0.5 in a float one put two tokens at one position."""
    batch, routing, tokens, mask, t_tokens, t_mask = _data(left_pad=True)
    guid, _ = _assemblers("columns", batch, routing, tokens, mask, tmp_path)
    layout = packed_layout(CU, total=TOTAL)
    want = layout.token_mask(t_mask)
    for odd in (t_mask.long() * 2, t_mask.float() * 0.5):
        assert torch.equal(layout.token_mask(odd), want)
        got = guid(t_tokens, odd, FallbackCounter(), layout=layout)
        filled = got[(0, "expert_fc1_in")].valid[0]
        assert bool(filled.any()) and not bool((filled & ~want[0]).any())


@pytest.mark.parametrize("path", ["records", "columns", "no-parts"])
def test_a_key_that_cannot_be_counted_is_refused_before_anything_is_counted(path):
    """A guided FC2 key without records and without ``topk`` (its rows per token unknown) is refused, and so is a
    bad ``topk`` beside a micro-batch without guidance: the keys before it had already been counted."""
    from megatron_trace.guidance.records import assemble

    from ._data import make_batch as make

    batch, _, tok, mask = make(B=2, lengths=[9, 7], layers=(0,), sites=("expert_fc1_in",))
    keys = [(0, "expert_fc1_in"), (0, "expert_fc2_in")]
    layout = PackedLayout.of([0, 9, 16])

    def run(ids, counter, **kw):
        if path == "records":
            samples = split_batch(batch, tok, version=0, attention_mask=mask)
            return assemble([None if i is None else samples[i] for i in ids], tok, versions=0, counter=counter,
                            attention_mask=mask, layout=layout, **kw)
        shard = GuidanceShard()
        shard.parts = [pack_guidance(batch, tok, version=0, attention_mask=mask)] if path == "columns" else []
        return shard.assemble(ids, tok, versions=0, counter=counter, attention_mask=mask, layout=layout, **kw)

    counter = FallbackCounter()
    if path != "no-parts":
        with pytest.raises(ValueError, match=r"guided key \(0, 'expert_fc2_in'\) has no record .* pass topk="):
            run([0, 1], counter, keys=keys)
        assert counter == FallbackCounter()
    with pytest.raises(ValueError, match=r"topk=0 must be an int >= 1"):
        run([None, None], counter, topk=0)
    assert counter == FallbackCounter()
    run([0, 1], counter, keys=keys, topk=2)  # (counted once topk is given: FC1 used or missing, FC2 missing)
    used = 0 if path == "no-parts" else 16
    assert (counter.used, dict(counter.fallback)) == (used, {"missing": 16 - used + 16 * 2})
