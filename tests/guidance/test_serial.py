"""Flat form of guidance (``guidance.serial``): one-pass writes, huge-page host buffers, CRC-32 checksums."""

import re
import zlib

import pytest
import torch

from megatron_trace.guidance.records import split_batch
from megatron_trace.guidance.serial import (
    ALIGN,
    RecordFormatError,
    add_checksums,
    checksum,
    checksums,
    flatten,
    host_buffer,
    plan_flat,
    unflatten,
    unflatten_one,
    write_flat,
)

from ._data import assert_samples_equal, make_batch


def _samples(fmt="nvfp4", compact=True):
    batch, _, tok, mask = make_batch(fmt=fmt, compact=compact)
    return split_batch(batch, tok, version=3, attention_mask=mask, sample_ids=list(range(tok.shape[0])))


def _reference_flat(plan) -> torch.Tensor:
    """Independent layout: zeros, then each planned tensor copied at its table offset."""
    ref = torch.zeros(plan.total, dtype=torch.uint8)
    for meta, views in zip(plan.metas, plan.parts):
        for (_, _, _, rel), v in zip(meta["tensors"], views):
            start = meta["offset"] + rel
            assert start % ALIGN == 0
            ref[start : start + v.numel()] = v.cpu()
    return ref


@pytest.mark.parametrize("fmt,compact", [("nvfp4", True), ("mxfp4", False)])
def test_write_flat_matches_per_tensor_layout_with_zero_padding(fmt, compact):
    plan = plan_flat(_samples(fmt, compact))
    out = torch.full((plan.total + 7,), 0xAB, dtype=torch.uint8)  # dirty target: padding must be rewritten
    used = write_flat(plan, out)
    assert used.data_ptr() == out.data_ptr() and used.numel() == plan.total
    assert torch.equal(used, _reference_flat(plan))
    assert torch.equal(out[plan.total :], torch.full((7,), 0xAB, dtype=torch.uint8))  # nothing past the plan


def test_write_flat_non_contiguous_target_uses_the_device_path():
    plan = plan_flat(_samples())
    out = torch.full((2 * plan.total,), 0xCD, dtype=torch.uint8)[::2]  # strided view: no memmove
    assert torch.equal(write_flat(plan, out), _reference_flat(plan))


def test_write_flat_rejects_small_or_wrong_dtype_target():
    plan = plan_flat(_samples())
    with pytest.raises(ValueError, match=f">= {plan.total} bytes"):
        write_flat(plan, torch.empty(plan.total - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        write_flat(plan, torch.empty(plan.total, dtype=torch.int8))
    assert write_flat(plan_flat([]), torch.empty(0, dtype=torch.uint8)).numel() == 0


@pytest.mark.parametrize("nbytes", [0, 100, (1 << 21) + 3, 3 << 21])
def test_host_buffer_is_a_writable_uint8_host_tensor(nbytes):
    b = host_buffer(nbytes)
    assert b.dtype == torch.uint8 and b.device.type == "cpu" and b.numel() == nbytes and b.is_contiguous()
    src = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    b.copy_(src)
    assert torch.equal(b, src)


def test_flatten_large_sample_round_trips_through_a_huge_page_buffer():
    batch, _, tok, mask = make_batch(B=2, S=4096, layers=(0, 1), fmt="nvfp4", compact=False)
    samples = split_batch(batch, tok, version=1, attention_mask=mask)
    metas, buf = flatten(samples)
    assert buf.numel() >= 1 << 21
    add_checksums(metas, buf)
    for a, b in zip(samples, unflatten(metas, buf, verify=True)):
        assert_samples_equal(a, b)


def test_checksum_is_crc32_of_the_bytes_in_place():
    x = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert checksum(x) == f"crc32:{zlib.crc32(bytes(x.tolist())):08x}"
    assert checksum(x[1::2]) == f"crc32:{zlib.crc32(bytes(x[1::2].tolist())):08x}"  # strided: copied first
    assert checksum(x[:0]) == "crc32:00000000"


def test_every_single_bit_flip_in_a_sample_span_is_detected():
    samples = _samples()
    metas, buf = flatten(samples)
    add_checksums(metas, buf)
    m = metas[0]
    for pos in range(m["offset"], m["offset"] + m["nbytes"], max(1, m["nbytes"] // 97)):
        bad = buf.clone()
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(RecordFormatError, match=f"sample {m['sample_id']}: checksum mismatch"):
            unflatten(metas, bad, verify=True)



def test_unflatten_one_with_verify_checks_its_own_span():
    samples = _samples()
    metas, buf = flatten(samples)
    add_checksums(metas, buf)
    spans = [buf[m["offset"] : m["offset"] + m["nbytes"]].clone() for m in metas]
    spans[1][spans[1].numel() // 2] ^= 4
    with pytest.raises(RecordFormatError, match=f"sample {metas[1]['sample_id']}: checksum mismatch"):
        unflatten_one(metas[1], spans[1], verify=True)
    assert_samples_equal(unflatten_one(metas[0], spans[0], verify=True), samples[0])

def test_parallel_checksums_equal_the_serial_ones():
    buf = torch.randint(0, 256, (20 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    spans = [buf[i << 20 : (i + 1) << 20] for i in range(20)]  # 20 MiB in total: threaded path
    assert checksums(spans) == [f"crc32:{zlib.crc32(memoryview(s.numpy())):08x}" for s in spans]


@pytest.mark.parametrize("edit, match", [
    ("drop_payload", r"site \(0, 'expert_fc1_in'\) has no tensor\(s\) \['payload'\]"),
    ("shape", r"site \(0, 'expert_fc1_in'\): payload rows \(\d+, 32\) != \(\d+, 16\) for full mxfp4 rows"),
    ("mode", r"mode 'compct' is not 'compact' or 'full'"),
])
def test_a_sample_whose_meta_does_not_fit_its_tensors_is_rejected(edit, match):
    """A tensor table without a site's payload, or a row shape / mode that does not fit the payload (a damaged
    header or shard metadata: the shards' checksums cover the tensors, not the metas) is an error naming the site,
    not a record with no payload or with bits read at the wrong width."""
    metas, buf = flatten(_samples("mxfp4", compact=False)[:1])
    m = metas[0]
    site = next(s for s in m["sites"] if (s["layer"], s["site"]) == (0, "expert_fc1_in"))
    if edit == "drop_payload":
        m["tensors"] = [t for t in m["tensors"] if t[0] != "0/expert_fc1_in/payload"]
    elif edit == "shape":
        site["shape"][-1] = 32  # hidden 40 -> 32: 16 payload bytes per row, the stored rows have 32
    else:
        site["mode"] = "compct"
    with pytest.raises(RecordFormatError, match=match):
        unflatten(metas, buf)


# ---- audit (session 56): table bounds a mutation run found untested ------------------------------------------
def test_unflatten_one_refuses_a_span_of_another_size_than_its_header_says():
    metas, buf = flatten(_samples())
    m = metas[1]
    span = buf[m["offset"] : m["offset"] + m["nbytes"]]
    for bad in (span[:-16], buf[m["offset"] : m["offset"] + m["nbytes"] + 16]):
        with pytest.raises(RecordFormatError, match=f"sample {m['sample_id']}: {bad.numel()} bytes, header says "
                                                    f"{m['nbytes']}"):
            unflatten_one(m, bad)


def test_a_tensor_table_entry_off_the_alignment_or_a_span_off_the_buffer_is_refused():
    """A payload entry moved one byte (a damaged meta: the checksum covers the span, not the table) would read every
    row shifted by a byte; a negative sample offset would slice from the buffer's end."""
    metas, buf = flatten(_samples())
    m = metas[0]
    name, _, shape, rel = m["tensors"][0]
    m["tensors"][0][3] = rel + 1
    with pytest.raises(RecordFormatError, match=re.escape(f"tensor {name} at {rel + 1}+")):
        unflatten(metas, buf)
    m["tensors"][0][3] = rel
    m["offset"] = -16
    with pytest.raises(RecordFormatError, match=re.escape(f"sample {m['sample_id']} spans -16+{m['nbytes']}")):
        unflatten(metas, buf)
    m["offset"] = 1  # (audit, session 59: a raw RuntimeError from viewing the amax bytes as float32)
    with pytest.raises(RecordFormatError, match=re.escape(f"sample {m['sample_id']} spans 1+{m['nbytes']}, buffer has "
                                                          f"{buf.numel()} bytes (samples start at 16-byte aligned")):
        unflatten(metas, buf)
    m["offset"] = None  # (audit, session 59: a bare KeyError / TypeError)
    with pytest.raises(RecordFormatError, match=re.escape(f"sample {m['sample_id']}: offset=None is not an int")):
        unflatten(metas, buf)
    m["offset"] = 0
    with pytest.raises(RecordFormatError, match=re.escape(f"spans {metas[-1]['offset']}+{metas[-1]['nbytes']}, "
                                                          f"buffer has {buf.numel() - 1} bytes")):
        unflatten(metas, buf[:-1], verify=True)  # (before any checksum is read)


def test_a_site_meta_with_an_empty_row_shape_is_a_format_error():
    """(Not an IndexError out of the width computation.)"""
    metas, buf = flatten(_samples()[:1])
    next(s for s in metas[0]["sites"] if s["site"] == "expert_fc1_in")["shape"] = []
    with pytest.raises(RecordFormatError, match=r"site \(0, 'expert_fc1_in'\): empty row shape"):
        unflatten(metas, buf)


def test_a_table_entry_moved_onto_another_tensor_s_bytes_is_refused():
    """An offset moved by a multiple of the alignment (a damaged meta: the checksum covers the span, not the table)
    read another tensor's bytes as this one's: a different record, accepted."""
    samples = _samples()
    metas, buf = flatten(samples[:1])
    m = metas[0]
    span = buf[m["offset"] : m["offset"] + m["nbytes"]]
    for i in range(1, len(m["tensors"])):
        for delta in (-16, 16):
            edited = {**m, "tensors": [list(t) for t in m["tensors"]]}
            edited["tensors"][i][3] += delta
            with pytest.raises(RecordFormatError, match=rf"sample {m['sample_id']}: bad tensor table: tensor \S+ "
                                                        r"at \d+\+\d+ outside \d+ bytes, off the 16-byte alignment or "
                                                        r"over the tensor before it"):  # (it, or the one after it)
                unflatten_one(edited, span)
    assert_samples_equal(unflatten_one(m, span), samples[0])


@pytest.mark.parametrize("edit, match", [
    ("rel=-16", r"tensor 0/expert_fc1_in/payload: offset -16 and shape \[9, 6\] must be ints >= 0"),
    ("valid rel=-32", r"tensor 0/expert_fc1_in/valid: offset -32 and shape \[9\] must be ints >= 0"),
    ("shape=huge", r"tensor 0/expert_fc1_in/payload: offset 0 and shape \[4611686018427387904, 4611686018427387904\]"
                   r"|tensor 0/expert_fc1_in/payload at 0\+\d+ outside"),
    ("valid as uint8", r"site \(0, 'expert_fc1_in'\): field dtypes \{'valid': torch.uint8\}"),
    ("amax renamed", r"tensors \['0/expert_fc1_in/amx'\] belong to no site field"),
    ("sample_id=1.5", r"sample_id=1.5 is not an int"),
    ("layer=0.0", r"layer=0.0 is not an int"),
    ("amax onto layer 2's", r"bad tensor table: tensor 2/expert_fc1_in/amax is in the table twice"),
], ids=["negative_offset", "negative_valid_offset", "huge_shape", "valid_uint8", "amax_renamed", "float_sample_id",
        "float_layer", "amax_renamed_onto_another_sites"])
def test_a_damaged_tensor_table_on_the_cache_path_is_a_format_error_naming_the_sample(edit, match):
    """``GuidanceCache.get`` decodes its samples with ``unflatten_one``: a damaged meta must raise the module's
    ``RecordFormatError`` naming the sample, not a raw torch error (a negative offset with the row shape of the
    site: ``RuntimeError`` from ``view``; a huge shape: ``numel`` overflow) and never a different record: a negative
    offset of the valid mask read bytes from the span's end, a dtype of ``uint8`` for ``valid`` reinterpreted the
    mask, a renamed amax dropped it and a float sample id or layer was truncated."""
    samples = _samples()
    metas, buf = flatten(samples[:1])
    m = metas[0]
    span = buf[m["offset"] : m["offset"] + m["nbytes"]]
    assert_samples_equal(unflatten_one(m, span), samples[0])
    entry = {t[0]: t for t in m["tensors"]}
    if edit == "rel=-16":
        entry["0/expert_fc1_in/payload"][3] = -16
    elif edit == "valid rel=-32":
        entry["0/expert_fc1_in/valid"][3] = -32
    elif edit == "shape=huge":
        entry["0/expert_fc1_in/payload"][2] = [2**62, 2**62]
    elif edit == "valid as uint8":
        entry["0/expert_fc1_in/valid"][1] = "uint8"
    elif edit == "amax renamed":
        entry["0/expert_fc1_in/amax"][0] = "0/expert_fc1_in/amx"
    elif edit == "amax onto layer 2's":  # (audit, session 59) layer 2 took layer 0's amax and layer 0 had none
        entry["0/expert_fc1_in/amax"][0] = "2/expert_fc1_in/amax"
    elif edit == "sample_id=1.5":
        m["sample_id"] = 1.5
    else:
        m["sites"][0]["layer"] = 0.0
    with pytest.raises(RecordFormatError, match=match) as e:
        unflatten_one(m, span)
    assert f"sample {m['sample_id']!r}" in str(e.value) or f"sample {m['sample_id']}" in str(e.value)
