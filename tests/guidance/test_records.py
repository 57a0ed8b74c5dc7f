import re

import pytest
import torch

from megatron_trace.formats import block, e2m1, mxfp4, nvfp4
from megatron_trace.formats.mxfp4 import MXFP4Format
from megatron_trace.guidance.records import (
    SampleGuidance,
    assemble,
    payload_of,
    split_batch,
    staleness_stats,
    token_hash,
)
from megatron_trace.guidance.serial import (
    RecordFormatError,
    add_checksums,
    flatten,
    sample_from_tensors,
    sample_to_tensors,
    unflatten,
)
from megatron_trace.guidance.site import NOT_GUIDED, FallbackCounter

from ._data import assert_samples_equal, make_batch

FORMATS = [("nvfp4", True), ("nvfp4", False), ("mxfp4", True), ("mxfp4", False)]
IDS = ["nvfp4-compact", "nvfp4-full", "mxfp4-compact", "mxfp4-full"]


def _samples(fmt="nvfp4", compact=True, **kw):
    batch, acts, tok, mask = make_batch(fmt=fmt, compact=compact, **kw)
    ids = [10, 11, 12][: tok.shape[0]]
    return split_batch(batch, tok, version=5, attention_mask=mask, sample_ids=ids), batch, tok, mask


@pytest.mark.parametrize("fmt,compact", FORMATS, ids=IDS)
def test_named_tensor_round_trip_bit_exact(fmt, compact):
    samples, *_ = _samples(fmt, compact)
    for s in samples:
        tensors, meta = sample_to_tensors(s)
        scales = [t for k, t in tensors.items() if k.endswith("/scales")]
        assert all(t.dtype == torch.uint8 for t in scales)
        back = sample_from_tensors(meta, {k: t.clone() for k, t in tensors.items()})
        assert_samples_equal(s, back)


@pytest.mark.parametrize("fmt,compact", FORMATS, ids=IDS)
def test_flat_round_trip_bit_exact(fmt, compact):
    samples, *_ = _samples(fmt, compact)
    metas, buf = flatten(samples)
    add_checksums(metas, buf)
    back = unflatten(metas, buf.clone(), verify=True)
    for a, b in zip(samples, back):
        assert_samples_equal(a, b)


def test_flat_checksum_detects_corruption():
    samples, *_ = _samples()
    metas, buf = flatten(samples)
    add_checksums(metas, buf)
    bad = buf.clone()
    bad[metas[1]["offset"] + 3] ^= 1
    with pytest.raises(RecordFormatError, match="checksum"):
        unflatten(metas, bad, verify=True)
    with pytest.raises(RecordFormatError, match="bytes"):
        unflatten(metas, buf[:-1])


@pytest.mark.parametrize("left_pad", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("fmt,compact", FORMATS, ids=IDS)
def test_split_then_assemble_restores_batch_rows(fmt, compact, left_pad):
    batch, _, tok, mask = make_batch(fmt=fmt, compact=compact, left_pad=left_pad)
    samples = split_batch(batch, tok, version=1, attention_mask=mask)
    assert [s.num_tokens for s in samples] == mask.sum(1).tolist()
    counter = FallbackCounter()
    out = assemble(samples, tok, versions=1, counter=counter, attention_mask=mask)
    assert out.keys() == batch.keys()
    for key, sg in batch.items():
        o = out[key]
        m = mask  # rows of tokens: identical bits; padding rows zero and invalid
        assert torch.equal(payload_of(o.record)[m], payload_of(sg.record)[m])
        assert torch.equal(o.record.block_scales.view(torch.uint8)[m], sg.record.block_scales.view(torch.uint8)[m])
        if fmt == "nvfp4":
            assert torch.equal(o.record.global_amax[m].view(torch.int32), sg.record.global_amax[m].view(torch.int32))
        assert torch.equal(o.valid, sg.valid)
        assert not payload_of(o.record)[~m].any()
        if sg.expert_ids is not None:
            assert torch.equal(o.expert_ids[m], sg.expert_ids[m])
        assert o.record.shape == sg.record.shape and o.record.fmt == fmt
    assert counter.coverage == 1.0 and not counter.fallback


def test_trainer_padding_differs_from_rollout():
    """Rollout left-padded to S=9, trainer right-padded to S=12: same tokens, same guidance rows."""
    batch, _, tok, mask = make_batch(left_pad=True)
    samples = split_batch(batch, tok, version=0, attention_mask=mask)
    L = mask.sum(1)
    t_tok = torch.zeros(3, 12, dtype=tok.dtype)
    for b in range(3):
        t_tok[b, : L[b]] = tok[b, mask[b]]
    counter = FallbackCounter()
    out = assemble(samples, t_tok, versions=0, counter=counter, lengths=L)
    key = (2, "expert_fc1_in")
    for b in range(3):
        assert torch.equal(payload_of(out[key].record)[b, : L[b]], payload_of(batch[key].record)[b, mask[b]])
    assert counter.coverage == 1.0


def _bracket_check(fmt, compact):
    """Trainer activations near the rollout's: guided codes == rollout codes wherever the rollout
    code is in the trainer's bracket, and RNE alone mismatches at some of those elements."""
    batch, acts, tok, mask = make_batch(fmt=fmt, compact=compact, sites=("expert_fc1_in", "expert_fc2_in"))
    samples = split_batch(batch, tok, version=2, attention_mask=mask)
    metas, buf = flatten(samples)
    received = unflatten(metas, buf)
    out = assemble(received, tok, versions=2, counter=FallbackCounter(), attention_mask=mask)
    g = torch.Generator().manual_seed(1)
    mod, form = (nvfp4, nvfp4.FORMAT) if fmt == "nvfp4" else (mxfp4, MXFP4Format())
    adjacent_flips = 0
    for key, sg in out.items():
        x_roll = acts[key]
        x_train = x_roll * (1 + 0.03 * torch.randn(x_roll.shape, generator=g))
        q_roll = (nvfp4.quantize(x_roll, per_row=True) if fmt == "nvfp4" else mxfp4.quantize(x_roll)).values()
        if not compact:  # the record's own codes are the rollout's codes
            assert torch.equal(e2m1.decode(batch[key].record.unpacked_codes())[..., : x_roll.shape[-1]], q_roll)
        guided = mod.guided_quantize(x_train, sg.record).values()
        _, z = block.guided_quantize_with_z(form, x_train, sg.record)  # z with the rollout's scales
        lo, hi = e2m1.bracket(z.flatten(-2)[..., : x_roll.shape[-1]])
        inside = ((q_roll == lo) | (q_roll == hi)) & sg.valid[..., None].expand_as(x_roll)
        assert torch.equal(guided[inside], q_roll[inside])
        grid = q_roll
        rne = (nvfp4.quantize(x_train, per_row=True) if fmt == "nvfp4" else mxfp4.quantize(x_train)).values()
        adjacent_flips += int(((rne != grid) & inside).sum())
    assert adjacent_flips > 0


@pytest.mark.parametrize("fmt,compact", FORMATS, ids=IDS)
def test_reconstructed_guidance_reproduces_rollout_codes(fmt, compact):
    _bracket_check(fmt, compact)


def test_rejects_wrong_token_hash_version_and_missing():
    batch, _, tok, mask = make_batch(B=4, lengths=[9, 8, 7, 9])
    samples = split_batch(batch, tok, version=[3, 3, 2, 3], attention_mask=mask)
    tok2 = tok.clone()
    tok2[1, 0] += 1  # sample 1: a different sequence
    counter = FallbackCounter()
    out = assemble([samples[0], samples[1], samples[2], None], tok2, versions=[3, 3, 3, 3], counter=counter,
                   attention_mask=mask)
    n_keys = len(batch)
    fc2_rows = 3  # topk
    per_tok = {"expert_fc2_in": fc2_rows}
    rows = lambda b: sum(mask[b].sum().item() * per_tok.get(k[1], 1) for k in batch)  # noqa: E731
    assert counter.fallback["token_hash"] == rows(1)
    assert counter.fallback["version"] == rows(2)  # generated by version 2, trainer recorded 3
    assert counter.fallback["missing"] == rows(3)
    assert counter.used == rows(0)
    for sg in out.values():
        assert sg.valid[0][mask[0]].all() and not sg.valid[1:].any()
    assert len(out) == n_keys


def test_rejects_shape_mismatch_and_counts_unrecorded_rows():
    batch, _, tok, mask = make_batch(B=2, lengths=[9, 9], sites=("expert_fc1_in",), layers=(0,))
    samples = split_batch(batch, tok, version=0, attention_mask=mask)
    other, _, _, _ = make_batch(B=2, lengths=[9, 9], sites=("expert_fc1_in",), layers=(0,), compact=False)
    wrong = split_batch(other, tok, version=0, attention_mask=mask)[1]  # full record among compact ones
    counter = FallbackCounter()
    assemble([samples[0], wrong, samples[0]], torch.cat([tok, tok[:1]]), versions=0, counter=counter)
    assert counter.fallback["shape"] == 9 and counter.used == 18
    # a row the rollout did not record (valid False) is counted, not used
    key = (0, "expert_fc1_in")
    v = batch[key].valid.clone()
    v[0, 4] = False
    from megatron_trace.guidance.site import SiteGuidance

    samples = split_batch({key: SiteGuidance(batch[key].record, v)}, tok, version=0)
    counter = FallbackCounter()
    out = assemble(samples, tok, versions=0, counter=counter)
    assert counter.fallback["not_recorded"] == 1 and not out[key].valid[0, 4]


def test_missing_key_everywhere_is_omitted_and_counted():
    batch, _, tok, mask = make_batch(B=2, lengths=[9, 9], layers=(0,), sites=("expert_fc1_in",))
    samples = split_batch(batch, tok, version=0, attention_mask=mask)
    counter = FallbackCounter()
    out = assemble(samples, tok, versions=0, counter=counter, keys=[(0, "expert_fc1_in"), (5, "kv_k")])
    assert list(out) == [(0, "expert_fc1_in")]
    assert counter.fallback["missing"] == 18


@pytest.mark.parametrize("packed", [False, True], ids=["samples", "columns"])
def test_missing_fc2_key_counts_topk_rows_per_token(packed):
    """A guided FC2 key no sample has: the trainer's layer falls back on top-k rows per token (one per token and
    chosen expert), so assembly counts as many ``missing`` rows, not one per token (coverage 1/2 here, not 2/3)."""
    from megatron_trace.guidance.packed_assemble import assemble_packed
    from megatron_trace.guidance.records import pack_guidance

    from ._data import DIMS

    batch, _, tok, mask = make_batch(B=2, lengths=[9, 7], layers=(0,), sites=("expert_fc1_in", "expert_fc2_in"))
    T, k = int(mask.sum()), DIMS["topk"]
    keys = [(layer, site) for layer in (0, 1) for site in ("expert_fc1_in", "expert_fc2_in")]

    def run(batch, **kw):
        counter = FallbackCounter()
        if packed:
            p = pack_guidance(batch, tok, version=0, attention_mask=mask)
            out = assemble_packed([p], [0, 1], tok, versions=0, counter=counter, attention_mask=mask, **kw)
        else:
            samples = split_batch(batch, tok, version=0, attention_mask=mask)
            out = assemble(samples, tok, versions=0, counter=counter, attention_mask=mask, **kw)
        return out, counter

    out, c = run(batch, keys=keys)  # top-k from the layer-0 FC2 records
    assert sorted(out) == keys[:2]
    assert (c.used, dict(c.fallback)) == (T * (1 + k), {"missing": T * (1 + k)}) and c.coverage == 0.5
    _, c = run(batch, keys=keys, topk=k)
    assert (c.used, dict(c.fallback)) == (T * (1 + k), {"missing": T * (1 + k)})
    fc1 = {key: v for key, v in batch.items() if key[1] == "expert_fc1_in"}  # no FC2 record anywhere
    _, c = run(fc1, keys=keys, topk=k)
    assert dict(c.fallback) == {"missing": T + 2 * T * k}
    with pytest.raises(ValueError, match=r"guided key \(0, 'expert_fc2_in'\) .* pass topk="):
        run(fc1, keys=keys)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=rf"topk={bad!r} must be an int >= 1"):
            run(batch, keys=keys, topk=bad)


def test_per_tensor_amax_expands_to_rows():
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    q = nvfp4.quantize(x)  # per-tensor amax []
    from megatron_trace.guidance.site import SiteGuidance

    tok = torch.arange(10).view(2, 5)
    key = (0, "expert_fc1_in")
    samples = split_batch({key: SiteGuidance(q.guidance(True), torch.ones(2, 5, dtype=torch.bool))}, tok, version=0)
    assert samples[0].sites[key].record.global_amax.dim() == 0
    out = assemble(samples, tok, versions=0, counter=FallbackCounter())
    rec = out[key].record
    assert rec.global_amax.shape == (2, 5, 1)
    assert torch.equal(nvfp4.guided_quantize(x, rec).codes, nvfp4.guided_quantize(x, q.guidance(True)).codes)


def test_bad_inputs_raise_clear_errors():
    batch, _, tok, mask = make_batch()
    with pytest.raises(ValueError, match="sample_ids"):
        split_batch(batch, tok, version=0, sample_ids=[1, 1, 2])
    with pytest.raises(ValueError, match="rows"):
        split_batch(batch, tok[:, :5], version=0)
    with pytest.raises(ValueError, match="lengths"):
        split_batch(batch, tok, version=0, lengths=[1, 2, 99])
    with pytest.raises(ValueError, match="samples for a batch"):
        assemble([None], tok, versions=0, counter=FallbackCounter())


def test_token_hash_is_content_hash():
    a = torch.tensor([1, 2, 3])
    assert token_hash(a) == token_hash(a.to(torch.int32)) != token_hash(torch.tensor([1, 2, 4]))
    assert token_hash(a) != token_hash(torch.tensor([1, 2, 3, 0]))


@pytest.mark.parametrize("tokens,got", [
    (torch.tensor([1.7, 2.2]), r"torch.float32 \(2,\)"),  # (was: hashed as tokens [1, 2])
    (torch.tensor([[1, 2], [3, 4]]), r"torch.int64 \(2, 2\)"),  # (was: hashed as one row)
    (torch.tensor([True]), r"torch.bool \(1,\)"), ([1, 2], "list"),
], ids=["float", "2-D", "bool", "list"])
def test_token_hash_refuses_what_is_not_one_sequence_of_token_ids(tokens, got):
    with pytest.raises(ValueError, match=rf"token_hash needs a 1-D integer tensor of token ids, got {got}"):
        token_hash(tokens)


@pytest.mark.parametrize("trainer,samples,match", [
    (3.5, [1], r"trainer_version=3.5 must be an int"), ("3", [1], r"trainer_version='3' must be an int"),
    (3, [1.7], r"sample_versions=\[1.7\] must be ints"), (3, 1, r"sample_versions=1 must be ints"),
], ids=["trainer-float", "trainer-str", "sample-float", "not-a-list"])
def test_staleness_stats_refuses_versions_that_are_not_ints(trainer, samples, match):
    """(were: 3.5 and 1.7 truncated to a staleness of 2, "3" parsed)"""
    with pytest.raises(ValueError, match=match):
        staleness_stats(trainer, samples)


@pytest.mark.parametrize("used,reasons,match", [
    (-1, None, r"\{'used': -1\}"), (2.5, None, r"\{'used': 2.5\}"), ("3", None, r"\{'used': '3'\}"),
    (1, {"missing": -3}, r"\{'missing': -3\}"), (0, {"missing": torch.tensor(2.0)}, r"\{'missing': tensor\(2.\)\}"),
], ids=["negative", "float", "str", "negative-reason", "float-tensor"])
def test_fallback_counter_refuses_counts_that_are_not_ints_ge_0(used, reasons, match):
    """(were: -3 fallback rows made a coverage of -0.5, 2.5 was truncated, "3" parsed)"""
    c = FallbackCounter()
    with pytest.raises(ValueError, match=rf"FallbackCounter.add needs row counts that are ints >= 0, got {match}"):
        c.add(used, reasons)
    assert c.used == 0 and not c.fallback
    c.add(torch.tensor(3), {"missing": 1, "version": 0})
    assert (c.used, dict(c.fallback), c.coverage) == (3, {"missing": 1}, 0.75)


def test_staleness_stats():
    d = staleness_stats(7, [7, 6, 6, 4])
    assert d["guidance/staleness_max"] == 3 and d["guidance/staleness_mean"] == 1.25
    assert d["guidance/staleness_frac_1"] == 0.5 and d["guidance/staleness_frac_0"] == 0.25
    with pytest.raises(ValueError, match="newer"):
        staleness_stats(3, [4])


def test_async_sample_with_old_version_is_accepted():
    """Async RL: a sample generated by policy v3, trained at v5, carries v3 guidance: accepted."""
    batch, _, tok, mask = make_batch(B=2, lengths=[9, 9])
    samples = split_batch(batch, tok, version=3, attention_mask=mask)
    counter = FallbackCounter()
    assemble(samples, tok, versions=[3, 3], counter=counter, attention_mask=mask)
    assert counter.coverage == 1.0
    assert staleness_stats(5, [s.version for s in samples])["guidance/staleness_max"] == 2


def test_sample_guidance_nbytes_sums_sites():
    samples, *_ = _samples()
    s: SampleGuidance = samples[0]
    assert s.nbytes() == sum(r.nbytes() for r in s.sites.values()) > s.guidance_nbytes() > 0


def test_zero_length_sample_round_trips():
    batch, _, tok, mask = make_batch(B=3, lengths=[9, 0, 4])
    samples = split_batch(batch, tok, version=0, attention_mask=mask)
    assert [s.num_tokens for s in samples] == [9, 0, 4]
    metas, buf = flatten(samples)
    for a, b in zip(samples, unflatten(metas, buf)):
        assert_samples_equal(a, b)
    counter = FallbackCounter()
    assemble(samples, tok, versions=0, counter=counter, attention_mask=mask)
    assert counter.coverage == 1.0 and counter.used == 13 * 2 * (3 + 3)  # 2 layers x (fc1, kv_k, kv_v, 3 fc2 rows)


def _corrupt(sg, fmt):
    """``sg`` with row (0, 1) of a NaN amax (NVFP4) or NaN scale byte (MXFP4), row (0, 2) an Inf amax / a
    negative scale (NVFP4), row (1, 0) a NaN scale byte and row (1, 1) a scale no quantizer writes: an amax of 0
    beside its nonzero block scales (NVFP4: a lost amax) or an E8M0 scale of 2**127 (MXFP4)."""
    import dataclasses

    from megatron_trace.guidance.site import SiteGuidance

    r = sg.record
    scales = r.block_scales.view(torch.uint8).clone()
    scales[1, 0, ..., 0] = 0xFF  # NaN in E4M3 and E8M0
    amax = None if r.global_amax is None else r.global_amax.clone()
    if fmt == "nvfp4":
        amax[0, 1] = float("nan")
        amax[0, 2] = float("inf")
        scales[0, 3, ..., 1] = 0xB8  # E4M3 -1.0
        assert bool((scales[1, 1] != 0).any())
        amax[1, 1] = 0.0
    else:
        scales[0, 1, ..., 0] = scales[0, 2, ..., 1] = 0xFF
        scales[1, 1, ..., 1] = 0xFE
    return SiteGuidance(dataclasses.replace(r, block_scales=scales.view(r.block_scales.dtype), global_amax=amax),
                        sg.valid, sg.expert_ids)


@pytest.mark.parametrize("path", ["samples", "columns"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_rows_with_a_nan_inf_or_negative_scale_are_rejected_and_counted(fmt, path):

    batch, acts, tok, mask = make_batch(B=2, S=6, lengths=[6, 6], layers=(0,), fmt=fmt,
                                        sites=("expert_fc1_in", "kv_k"))
    key = (0, "expert_fc1_in")
    batch[key] = _corrupt(batch[key], fmt)
    bad = {(0, 1), (0, 2), (1, 0), (1, 1)} | ({(0, 3)} if fmt == "nvfp4" else set())
    counter = FallbackCounter()
    out = _assemble_on(path, batch, tok, mask, counter)
    want = torch.ones(2, 6, dtype=torch.bool)
    for b, s in bad:
        want[b, s] = False
    assert torch.equal(out[key].valid, want)
    assert out[(0, "kv_k")].valid.all()  # the other site untouched
    assert counter.fallback == {"bad_scale": len(bad)}
    assert counter.used == 12 - len(bad) + 12  # + the kv_k tokens


def _assemble_on(path: str, batch, tok, mask, counter):
    """Version-0 records of the whole batch, assembled per sample ("samples") or from the packed columns."""
    from megatron_trace.guidance.packed_assemble import assemble_packed
    from megatron_trace.guidance.records import pack_guidance

    if path == "samples":
        return assemble(split_batch(batch, tok, version=0, attention_mask=mask), tok, versions=0, counter=counter)
    return assemble_packed([pack_guidance(batch, tok, version=0, attention_mask=mask)], [0, 1], tok, versions=0,
                           counter=counter)


@pytest.mark.parametrize("path", ["samples", "columns"])
def test_a_bad_scale_on_a_row_the_rollout_did_not_record_counts_once_as_not_recorded(path):
    """``bad_scale`` counts valid rows only: a row already invalid (``not_recorded``) was never counted used, so its
    NaN scale neither moves it to ``bad_scale`` nor takes a row off ``used``."""
    import dataclasses

    from megatron_trace.guidance.site import SiteGuidance

    batch, _, tok, mask = make_batch(B=2, S=6, lengths=[6, 6], layers=(0,), sites=("expert_fc1_in",))
    key = (0, "expert_fc1_in")
    sg = batch[key]
    valid, scales = sg.valid.clone(), sg.record.block_scales.view(torch.uint8).clone()
    valid[0, 1] = False
    scales[0, 1, 0] = 0xFF  # NaN, on the row the rollout marked invalid
    rec = dataclasses.replace(sg.record, block_scales=scales.view(sg.record.block_scales.dtype))
    batch[key] = SiteGuidance(rec, valid)
    counter = FallbackCounter()
    out = _assemble_on(path, batch, tok, mask, counter)
    assert counter.fallback == {"not_recorded": 1} and counter.used == 11
    assert torch.equal(out[key].valid, valid)

def test_an_nvfp4_record_without_amax_is_a_layout_mismatch():
    import dataclasses

    from megatron_trace.guidance.records import SiteRecord

    batch, _, tok, mask = make_batch(B=2, S=5, lengths=[5, 5], layers=(0,), sites=("expert_fc1_in",))
    key = (0, "expert_fc1_in")
    samples = split_batch(batch, tok, version=0, attention_mask=mask)
    r = samples[1].sites[key]
    noamax = SiteRecord(dataclasses.replace(r.record, global_amax=None), r.valid)
    samples[1] = SampleGuidance(1, 0, samples[1].token_hash, 5, {key: noamax})
    counter = FallbackCounter()
    out = assemble(samples, tok, versions=0, counter=counter)
    assert counter.fallback == {"shape": 5} and counter.used == 5
    assert out[key].valid[0].all() and not out[key].valid[1].any()


@pytest.mark.parametrize("path", ["samples", "columns"])
def test_a_micro_batch_without_any_guidance_has_coverage_zero(path):
    from megatron_trace.guidance.packed_assemble import assemble_packed
    from megatron_trace.guidance.records import pack_guidance

    batch, _, tok, mask = make_batch(B=2, S=5, lengths=[5, 4], layers=(0,), sites=("expert_fc1_in",))
    counter = FallbackCounter()
    if path == "samples":
        out = assemble([None, None], tok, versions=0, counter=counter, attention_mask=mask)
    else:
        parts = [pack_guidance(batch, tok, version=0, attention_mask=mask, sample_ids=[7, 8])]
        out = assemble_packed(parts, [None, 3], tok, versions=0, counter=counter, attention_mask=mask)
    assert out == {} and counter.fallback == {"missing": 9} and counter.coverage == 0.0


# ---- malformed inputs: named errors or counted samples, never a crash deep in an index copy ------------------
def test_versions_may_be_numpy_or_0d_tensor_integers():
    import numpy as np

    from megatron_trace.guidance.routing import assemble_routing, split_routing

    batch, _, tok, mask = make_batch(B=3, S=9, layers=(0,), sites=("expert_fc1_in",))
    want = split_batch(batch, tok, version=5, attention_mask=mask)
    routing = {0: torch.randint(0, 8, (3, 9, 2), generator=torch.Generator().manual_seed(0))}
    for v in (np.int64(5), torch.tensor(5)):
        got = split_batch(batch, tok, version=v, attention_mask=mask)
        assert [s.version for s in got] == [5, 5, 5] and all(isinstance(s.version, int) for s in got)
        c = FallbackCounter()
        assemble(got, tok, versions=v, counter=c, attention_mask=mask)
        assert c.fallback == {} and c.used == int(mask.sum())
        r = split_routing(routing, tok, version=v, num_experts=8, attention_mask=mask)
        out = assemble_routing(r, tok, versions=v, attention_mask=mask)
        assert torch.equal(out[0][mask], routing[0][mask])
    for s, w in zip(got, want):
        assert_samples_equal(s, w)
    with pytest.raises(ValueError, match=r"versions=1.5: give an int or 3 ints"):
        assemble(want, tok, versions=1.5, counter=FallbackCounter(), attention_mask=mask)


def test_routing_of_another_top_k_is_a_named_mismatch_and_padding_ids_are_not_checked():
    from megatron_trace.guidance.routing import RoutingMismatchError, assemble_routing, split_routing

    _, _, tok, mask = make_batch(B=3, S=9, layers=(0,), sites=("expert_fc1_in",))
    g = torch.Generator().manual_seed(1)
    top2 = split_routing({0: torch.randint(0, 8, (3, 9, 2), generator=g)}, tok, version=1, num_experts=8,
                         attention_mask=mask)
    top4 = split_routing({0: torch.randint(0, 8, (3, 9, 4), generator=g)}, tok, version=1, num_experts=8,
                         attention_mask=mask)
    with pytest.raises(RoutingMismatchError, match="batch row 1: layer 0 has top-4 expert ids, the other samples "
                                                   "top-2"):
        assemble_routing([top2[0], top4[1], top2[2]], tok, versions=1, attention_mask=mask)
    r = torch.randint(0, 8, (3, 9, 2), generator=g)
    padded = r.masked_fill(~mask[..., None], -1)  # an engine's padding
    got = split_routing({0: padded}, tok, version=1, num_experts=8, attention_mask=mask)
    assert torch.equal(assemble_routing(got, tok, versions=1, attention_mask=mask)[0][mask], r[mask])
    with pytest.raises(ValueError, match=r"routing\[0\] holds expert id 8 at a token position: expert ids are 0..7"):
        split_routing({0: r.masked_fill(mask[..., None], 8)}, tok, version=1, num_experts=8, attention_mask=mask)


def test_a_global_amax_neither_one_value_nor_one_per_row_is_named():
    from megatron_trace.guidance.records import SiteRecord, with_tensors
    from megatron_trace.guidance.site import SiteGuidance

    batch, _, tok, mask = make_batch(B=2, S=5, layers=(0,), sites=("expert_fc1_in", "kv_k"))
    for key, bad in (((0, "expert_fc1_in"), lambda g: g[..., 0]), ((0, "kv_k"), lambda g: g.amax(2)),
                     ((0, "expert_fc1_in"), lambda g: g.amax().reshape(1))):
        sg = batch[key]
        r = sg.record
        amax = bad(r.global_amax)
        rec = with_tensors(r, payload_of(r), r.block_scales, amax, r.shape)
        want = f"global_amax shape {tuple(amax.shape)} must be [] (one amax) or {(*r.shape[:-1], 1)} (one per row)"
        with pytest.raises(ValueError, match=re.escape(want)):
            SiteGuidance(rec, sg.valid)
        one = with_tensors(r, payload_of(r)[0], r.block_scales[0], amax[0] if amax.dim() > 1 else amax, r.shape[1:])
        with pytest.raises(ValueError, match="global_amax shape"):
            SiteRecord(one, sg.valid[0])


def test_a_sample_with_narrower_expert_ids_assembles_as_int64():
    import dataclasses

    from megatron_trace.guidance.records import SiteRecord

    batch, _, tok, mask = make_batch(B=3, S=9, layers=(0,), sites=("expert_fc2_in",))
    samples = split_batch(batch, tok, version=1, attention_mask=mask)
    key = (0, "expert_fc2_in")
    rec = samples[1].sites[key]
    narrow = dataclasses.replace(samples[1], sites={key: SiteRecord(rec.record, rec.valid, rec.expert_ids.int())},
                                 source=None)
    want = assemble(samples, tok, versions=1, counter=FallbackCounter(), attention_mask=mask)[key]
    got = assemble([samples[0], narrow, samples[2]], tok, versions=1, counter=FallbackCounter(),
                   attention_mask=mask)[key]
    assert got.expert_ids.dtype == torch.int64 and torch.equal(got.expert_ids, want.expert_ids)
    assert got.scales_checked and not batch[key].scales_checked  # (the trainer's step need not look again)
    with pytest.raises(ValueError, match=re.escape(f"expert_ids must be integer of shape {tuple(rec.valid.shape)}")):
        SiteRecord(rec.record, rec.valid, rec.expert_ids.float())


@pytest.mark.parametrize("fmt,compact", FORMATS, ids=IDS)
def test_a_payload_or_scales_of_another_dtype_is_refused_by_name(fmt, compact):
    """An int16 / float32 payload or a scale tensor of another dtype was accepted (and assembled, sent, counted as
    used): records are packed uint8 with the format's scale dtype."""
    from megatron_trace.guidance.records import SiteRecord, with_tensors
    from megatron_trace.guidance.site import SiteGuidance

    batch, _, tok, mask = make_batch(B=2, S=5, layers=(0,), sites=("expert_fc1_in",), fmt=fmt, compact=compact)
    sg = batch[(0, "expert_fc1_in")]
    r = sg.record
    name = "mantissa_bits" if compact else "codes"
    for dtype in (torch.int16, torch.float32, torch.int8):
        bad = with_tensors(r, payload_of(r).to(dtype), r.block_scales, r.global_amax, r.shape)
        with pytest.raises(ValueError, match=re.escape(f"{name} is {dtype}: guidance payloads are packed torch.uint8")):
            SiteGuidance(bad, sg.valid)
        with pytest.raises(ValueError, match="packed torch.uint8"):
            SiteRecord(with_tensors(bad, payload_of(bad)[0], r.block_scales[0], None if r.global_amax is None
                                    else r.global_amax[0], r.shape[1:]), sg.valid[0])
    scales = with_tensors(r, payload_of(r), r.block_scales.view(torch.uint8), r.global_amax, r.shape)
    with pytest.raises(ValueError, match=re.escape(f"{fmt} block_scales are torch.uint8, the format's are")):
        SiteGuidance(scales, sg.valid)


def _e4m3_ok(byte: int) -> bool:
    """An E4M3 scale byte decoded by hand: a usable scale is not NaN (exponent and mantissa all ones) and not
    negative (the sign bit set on anything but zero)."""
    sign, exp, man = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    return not (exp == 0xF and man == 0x7) and not (sign and (exp or man))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_scales_ok_on_every_scale_byte_and_amax_value(fmt, device):
    """``scales_ok`` against a by-hand decode of all 256 scale bytes (in the second block of a row whose first
    block is 1.0; E8M0's 2**127 is no quantizer's: MXFP4's and SGLang's largest exponent is 126) and against Python's
    floats for NVFP4's global amax (per row, per tensor, KV heads): an amax of 0 only beside all-zero scales."""
    from megatron_trace.formats import CompactGuidance
    from megatron_trace.guidance.records import scales_ok
    from megatron_trace.guidance.site import SiteGuidance

    nvfp4_ = fmt == "nvfp4"
    bs, one = (16, 0x38) if nvfp4_ else (32, 127)  # the block size and the byte of scale 1.0
    dtype = torch.float8_e4m3fn if nvfp4_ else torch.float8_e8m0fnu

    def sg(scale_bytes, amax, valid_shape):
        rows = scale_bytes.shape[:-1]
        rec = CompactGuidance(mantissa_bits=torch.zeros(*rows, 2 * bs // 8, dtype=torch.uint8, device=device),
                              block_scales=scale_bytes.to(device).view(dtype), global_amax=amax,
                              shape=(*rows, 2 * bs), fmt=fmt)
        return SiteGuidance(rec, torch.ones(valid_shape, dtype=torch.bool, device=device))

    second = torch.arange(256, dtype=torch.uint8).view(1, 256)
    scales = torch.stack([torch.full_like(second, one), second], -1)  # [1, 256, 2]
    amax = torch.ones(1, 256, 1, device=device) if nvfp4_ else None
    want = torch.tensor([[_e4m3_ok(b) if nvfp4_ else b < 0xFE for b in range(256)]])
    assert torch.equal(scales_ok(sg(scales, amax, (1, 256))).cpu(), want)
    if not nvfp4_:
        return
    values = [0.0, -0.0, 1.0, 3.4028234663852886e38, 1e-45, -1e-30, -1.0, float("inf"), float("-inf"), float("nan")]
    good = torch.full((1, len(values), 2), one, dtype=torch.uint8)
    per_row = torch.tensor(values, device=device).view(1, -1, 1)
    zero = torch.tensor([0x00, 0x80], dtype=torch.uint8).expand(1, len(values), 2)  # 0 and -0: an all-zero row's
    for scales, amax_ok in ((good, lambda v: v > 0), (zero, lambda v: v >= 0)):
        want = torch.tensor([[v == v and v != float("inf") and amax_ok(v) for v in values]])
        assert torch.equal(scales_ok(sg(scales, per_row, (1, len(values)))).cpu(), want)
        for v in values:  # one amax for the whole tensor
            ok = scales_ok(sg(scales, torch.tensor(v, device=device), (1, len(values)))).cpu()
            assert torch.equal(ok, torch.full_like(want, v == v and v != float("inf") and amax_ok(v))), v
    kv = good.view(1, len(values), 1, 2).repeat(1, 1, 4, 1)  # [B, S, heads, blocks]: one bad head fails the token
    kv[0, 3, 2, 1] = 0xFF
    kv_amax = torch.ones(1, len(values), 4, 1, device=device)
    kv_amax[0, 5, 1] = float("inf")
    want = torch.ones(1, len(values), dtype=torch.bool)
    want[0, 3] = want[0, 5] = False
    assert torch.equal(scales_ok(sg(kv, kv_amax, (1, len(values)))).cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu])
def test_scales_usable_on_every_pair_of_scale_bytes(dtype):
    """``scales_usable`` reads the scales as bytes: every row of two scale bytes (65,536 rows) against the by-hand
    decode, for the NVFP4 amax kinds (0: only beside +-0 scales; per row and per tensor) and MXFP4 (no amax)."""
    from megatron_trace.formats.tensor import scales_usable

    pairs = torch.cartesian_prod(torch.arange(256), torch.arange(256))  # [65536, 2] int64
    if dtype == torch.float8_e8m0fnu:
        want = torch.tensor([a < 0xFE and b < 0xFE for a, b in pairs.tolist()])
        assert torch.equal(scales_usable(pairs.to(torch.uint8).view(dtype), None), want)
        return
    ok = torch.tensor([_e4m3_ok(v) for v in range(256)])
    zero = torch.tensor([v in (0x00, 0x80) for v in range(256)])
    scales = pairs.to(torch.uint8).view(dtype)
    for amax in (1.0, 0.0, -0.0):
        want = ok[pairs].all(1) & (zero[pairs].all(1) if amax == 0 else True)
        assert torch.equal(scales_usable(scales, torch.full((65536, 1), amax)), want), amax
        assert torch.equal(scales_usable(scales, torch.tensor(amax)), want), amax


@pytest.mark.parametrize("num_experts,nbytes", [(256, 1), (257, 2), (32768, 2), (32769, 4)])
def test_routing_ids_take_the_fewest_bytes_that_hold_every_expert(num_experts, nbytes):
    """DeepSeek-V3's 256 experts (ids 0..255) fit one byte a (token, slot): 257 need two, 32769 four. The ids come
    back exactly, the largest included, and only for the policy version they were recorded with."""
    from megatron_trace.guidance.routing import RoutingMismatchError, assemble_routing, split_routing

    tokens = torch.tensor([[3, 4, 5]])
    ids = torch.tensor([[[0, num_experts - 1], [num_experts - 1, 1], [2, num_experts - 2]]])
    (s,) = split_routing({0: ids}, tokens, version=0, num_experts=num_experts)
    assert s.nbytes() == 3 * 2 * nbytes
    assert torch.equal(assemble_routing([s], tokens, versions=0)[0], ids)
    with pytest.raises(RoutingMismatchError, match="batch row 0: sample 0 has version 0, the trainer expects 1"):
        assemble_routing([s], tokens, versions=1)
    with pytest.raises(ValueError, match=rf"holds expert id {num_experts} at a token position: expert ids are "
                                         rf"0..{num_experts - 1}"):
        split_routing({0: ids.clamp(max=0) + num_experts}, tokens, version=0, num_experts=num_experts)


def test_a_valid_mask_that_is_not_bool_is_refused_by_name():
    """A 0/1 uint8 ``valid`` would index rows 0 and 1 instead of masking them."""
    import dataclasses

    batch, _, _, _ = make_batch(layers=(0,), sites=("expert_fc1_in",))
    sg = batch[(0, "expert_fc1_in")]
    with pytest.raises(ValueError, match=r"valid must be bool of shape \(\d+, \d+\), got torch.uint8"):
        dataclasses.replace(sg, valid=sg.valid.to(torch.uint8))


def test_coverage_without_guided_rows_is_full():
    """Rows of layers outside the policy are not guided sites: a step that guides no layer misses nothing (it must
    not trip ``min_coverage``); rows that fell back at guided sites count against it."""
    c = FallbackCounter()
    assert c.coverage == 1.0
    c.add(0, {NOT_GUIDED: 12})
    assert c.coverage == 1.0 and c.as_dict()["guidance/coverage"] == 1.0
    c.add(3, {"not_recorded": 1})
    assert c.coverage == 0.75


# ---- audit (session 56): boundaries and checks a mutation run found untested ------------------------------
def test_token_mask_bounds_lengths_and_checks_the_mask_it_is_given():
    """``lengths`` of exactly 0 and S are tokens counts; -1 and S + 1 are refused (S + 1 would silently read as
    S). An attention mask of another shape, or a mask given with lengths, is refused by name."""
    from megatron_trace.guidance.records import token_mask

    tok = torch.arange(1, 13).view(3, 4)
    assert token_mask(tok, lengths=[0, 4, 2]).sum(1).tolist() == [0, 4, 2]
    for bad in ([5, 4, 2], [-1, 4, 2]):
        with pytest.raises(ValueError, match=re.escape(f"lengths must be [B=3] with values in 0..4, got {bad}")):
            token_mask(tok, lengths=bad)
    mask = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=re.escape("attention_mask shape (3, 3) != token_ids shape (3, 4)")):
        token_mask(tok, attention_mask=mask[:, :3])
    with pytest.raises(ValueError, match="give attention_mask or lengths, not both"):
        token_mask(tok, attention_mask=mask, lengths=[4, 4, 4])


def test_versions_of_another_length_than_the_batch_are_refused():
    """Four versions for three rows would silently leave the last one unused (and misalign a caller's rows)."""
    batch, _, tok, mask = make_batch(B=3, S=9, layers=(0,), sites=("expert_fc1_in",))
    samples = split_batch(batch, tok, version=5, attention_mask=mask)
    for versions in ([5, 5], [5, 5, 5, 5]):
        with pytest.raises(ValueError, match=f"versions has {len(versions)} entries for a batch of 3"):
            assemble(samples, tok, versions=versions, counter=FallbackCounter(), attention_mask=mask)
        with pytest.raises(ValueError, match=f"version has {len(versions)} entries for a batch of 3"):
            split_batch(batch, tok, version=versions, attention_mask=mask)


def test_versions_that_are_not_integers_are_refused_not_truncated():
    """A version of 3.5 (or a float tensor of versions) was truncated to 3: a float where the policy version belongs
    is a caller's bug, and truncating it could accept guidance of another policy version."""
    import numpy as np

    batch, _, tok, mask = make_batch(B=3, S=9, layers=(0,), sites=("expert_fc1_in",))
    samples = split_batch(batch, tok, version=3, attention_mask=mask)
    for bad in ([3.5, 3, 3], torch.tensor(3.0), torch.tensor([3.0, 3.0, 3.0]), [3, True, 3], np.float64(3.0)):
        with pytest.raises(ValueError, match=re.escape(f"versions={bad!r}: give an int or 3 ints")):
            assemble(samples, tok, versions=bad, counter=FallbackCounter(), attention_mask=mask)
        with pytest.raises(ValueError, match=re.escape(f"version={bad!r}: give an int or 3 ints")):
            split_batch(batch, tok, version=bad, attention_mask=mask)
    for good in ([3, np.int64(3), torch.tensor(3)], torch.tensor([3, 3, 3]), np.array([3, 3, 3])):
        c = FallbackCounter()
        assemble(samples, tok, versions=good, counter=c, attention_mask=mask)
        assert c.fallback == {} and c.used == int(mask.sum())


def test_sample_ids_that_are_not_integers_are_refused_not_truncated():
    """A sample id of 3.5 was truncated to 3 (``int(i)``): that record would then be served as sample 3's guidance.
    Integer ids of any kind (NumPy, 0-d tensors, an int tensor) are kept as Python ints."""
    import numpy as np

    from megatron_trace.guidance.records import pack_guidance
    from megatron_trace.guidance.routing import split_routing

    batch, _, tok, mask = make_batch(B=3, S=9, layers=(0,), sites=("expert_fc1_in",))
    routing = {0: torch.zeros(3, 9, 2, dtype=torch.int64)}  # the routing of the same batch takes the same ids
    for bad in ([0, 1, 3.5], [0.0, 1.0, 2.0], torch.tensor([0.0, 1.0, 2.0]), [0, True, 2], [0, 1, np.float64(2)], 7):
        with pytest.raises(ValueError, match=re.escape(f"sample_ids={bad!r}: give 3 distinct int ids")):
            split_batch(batch, tok, version=0, attention_mask=mask, sample_ids=bad)
        with pytest.raises(ValueError, match=re.escape(f"sample_ids={bad!r}: give 3 distinct int ids")):
            pack_guidance(batch, tok, version=0, attention_mask=mask, sample_ids=bad)
        with pytest.raises(ValueError, match=re.escape(f"sample_ids={bad!r}: give 3 distinct int ids")):
            split_routing(routing, tok, version=0, num_experts=8, attention_mask=mask, sample_ids=bad)
    for good in ([5, np.int64(3), torch.tensor(4)], torch.tensor([5, 3, 4]), np.array([5, 3, 4])):
        got = split_batch(batch, tok, version=0, attention_mask=mask, sample_ids=good)
        assert [s.sample_id for s in got] == [5, 3, 4] and all(type(s.sample_id) is int for s in got)
        got = split_routing(routing, tok, version=0, num_experts=8, attention_mask=mask, sample_ids=good)
        assert [s.sample_id for s in got] == [5, 3, 4] and all(type(s.sample_id) is int for s in got)


@pytest.mark.parametrize("routing,match", [
    ({0: torch.full((3, 9, 2), 2.7)}, r"routing\[0\] must be an integer tensor of expert ids, got torch.float32"),
    ({0: torch.ones(3, 9, 2, dtype=torch.bool)}, r"routing\[0\] must be an integer tensor .*, got torch.bool"),
    ({0: [[[1, 2]]]}, r"routing\[0\] must be an integer tensor of expert ids, got list"),
    ({"0": torch.zeros(3, 9, 2, dtype=torch.int64)}, r"routing has layer '0': layers are int layer ids"),
    ({True: torch.zeros(3, 9, 2, dtype=torch.int64)}, r"routing has layer True: layers are int layer ids"),
])
def test_routing_that_is_no_integer_expert_ids_by_int_layer_is_refused(routing, match):
    """Float ids were cast to the id dtype (2.7 replayed as expert 2), a layer "0" was carried but never replayed by
    layer 0."""
    from megatron_trace.guidance.routing import split_routing

    _, _, tok, mask = make_batch(B=3, S=9, layers=(0,), sites=("expert_fc1_in",))
    with pytest.raises(ValueError, match=match):
        split_routing(routing, tok, version=0, num_experts=8, attention_mask=mask)


@pytest.mark.parametrize("bad", [1.5, True, "8", 0, 2**40])
def test_id_dtype_refuses_a_number_of_experts_that_is_no_int_it_can_hold(bad):
    """1.5 and True were taken; 2**40 experts got int32 ids, which overflow."""
    from megatron_trace.guidance.routing import id_dtype

    with pytest.raises(ValueError, match=re.escape(f"num_experts={bad!r} must be an int in [1, 2**31]")):
        id_dtype(bad)
    assert id_dtype(256) == torch.uint8 and id_dtype(257) == torch.int16 and id_dtype(2**31) == torch.int32
