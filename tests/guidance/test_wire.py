"""Columnar sync chunks (``guidance.wire``, protocol 6) and assembly from columns (``packed_assemble``), in process:
``GuidanceSync.encode`` -> ``_decode`` without a process group (the multi-process paths are in test_sync.py)."""

import dataclasses
import json
import re
import zlib

import pytest
import torch

from megatron_trace.formats import nvfp4
from megatron_trace.guidance.packed import source_of
from megatron_trace.guidance.records import SampleGuidance, SiteRecord, assemble, payload_of, split_batch
from megatron_trace.guidance.routing import RoutingMismatchError, assemble_routing, split_routing
from megatron_trace.guidance.site import FallbackCounter, SiteGuidance
from megatron_trace.guidance.sync import PROTOCOL, GuidanceShard, GuidanceSync, GuidanceSyncError

from ._data import assert_samples_equal, make_batch

FORMATS = [("nvfp4", True), ("nvfp4", False), ("mxfp4", True), ("mxfp4", False)]
IDS = ["nvfp4-compact", "nvfp4-full", "mxfp4-compact", "mxfp4-full"]


def _sync(verify=True) -> GuidanceSync:
    s = GuidanceSync.__new__(GuidanceSync)  # encode / _decode need no process group
    s.verify, s.src = verify, 0
    return s


def _decode(msgs, verify=True) -> GuidanceShard:
    payload = msgs[2] if len(msgs) > 2 else torch.empty(0, dtype=torch.uint8)
    g, r = _sync(verify)._decode(msgs[1], payload, int(msgs[0][5]))
    shard = GuidanceShard()
    shard.parts += [g] if g is not None else []
    shard.routing_parts += [r] if r is not None else []
    return shard


def _head(msgs) -> dict:
    return json.loads(bytes(msgs[1].tolist()))


def _with_header(msgs, head, crc: bool = True) -> list:
    """``msgs`` with the header ``head``; ``crc``: its size message updated too (a sender that wrote this header),
    else the sent header changed on the way."""
    raw = json.dumps(head).encode()
    sizes = msgs[0].clone()
    if crc:
        sizes[1], sizes[5] = len(raw), zlib.crc32(raw)
    return [sizes, torch.frombuffer(bytearray(raw), dtype=torch.uint8), *msgs[2:]]


def _data(fmt="nvfp4", compact=True, B=4, lengths=(9, 7, 0, 5), left_pad=False, seed=0):
    batch, _, tok, mask = make_batch(B=B, lengths=list(lengths), fmt=fmt, compact=compact, left_pad=left_pad,
                                     seed=seed)
    ids = [100 + b for b in range(B)]
    samples = split_batch(batch, tok, version=3, attention_mask=mask, sample_ids=ids)
    g = torch.Generator().manual_seed(seed + 1)
    routing = split_routing({layer: torch.randint(0, 8, (B, tok.shape[1], 3), generator=g) for layer in (0, 2)},
                            tok, version=3, num_experts=8, attention_mask=mask, sample_ids=ids)
    return samples, routing, tok, mask, batch


def _own_tensors(s: SampleGuidance) -> SampleGuidance:
    """The same records as separate tensors (no ``source``): the per-sample (cat) send path."""
    return SampleGuidance(s.sample_id, s.version, s.token_hash, s.num_tokens, {k: r.to("cpu") for k, r in
                                                                               s.sites.items()})


def _assert_routing_equal(a, b):
    assert [(r.sample_id, r.version, r.token_hash, r.num_tokens) for r in a] == \
        [(r.sample_id, r.version, r.token_hash, r.num_tokens) for r in b]
    for x, y in zip(a, b):
        assert x.experts.keys() == y.experts.keys()
        assert all(x.experts[k].dtype == y.experts[k].dtype and torch.equal(x.experts[k], y.experts[k])
                   for k in x.experts)


@pytest.mark.parametrize("path", ["columns", "own_tensors"])
@pytest.mark.parametrize("fmt,compact", FORMATS, ids=IDS)
def test_round_trip_is_bit_exact_on_both_send_paths(fmt, compact, path):
    samples, routing, *_ = _data(fmt, compact, left_pad=True)
    if path == "own_tensors":
        samples = [_own_tensors(s) for s in samples]
    assert (source_of(samples) is not None) == (path == "columns")
    if path == "columns":  # chunking reads sizes from the columns: the same as the samples' own
        assert samples[0].source[0].sample_nbytes == [s.nbytes() for s in samples]
    msgs = _sync().encode(samples, routing)
    assert _head(msgs)["protocol"] == PROTOCOL
    shard = _decode([m.clone() for m in msgs])
    assert shard.stats.samples == 0  # stats are receive_shard's; the views are what matters here
    for a, b in zip(shard.samples, samples, strict=True):
        assert_samples_equal(a, b)
    _assert_routing_equal(shard.routing, routing)


def test_padding_between_fields_is_zero_and_payload_ends_with_the_last_field():
    samples, routing, *_ = _data()
    msgs = _sync().encode(samples, routing)
    covered = torch.zeros(msgs[2].numel(), dtype=torch.bool)
    for sec in ("guidance", "routing"):
        for col in _head(msgs)[sec]["columns"]:
            for _name, dt, shape, off, crc in col["fields"]:
                n = torch.Size(shape).numel() * {"uint8": 1, "bool": 1, "float32": 4, "int64": 8}[dt]
                assert off % 16 == 0 and crc.startswith("crc32:")
                covered[off : off + n] = True
    assert covered[-1] and not msgs[2][~covered].any()


def test_edited_samples_are_sent_as_edited_not_from_their_columns():
    samples, _, tok, mask, batch = _data()
    other = split_batch(make_batch(B=4, lengths=[9, 7, 0, 5], seed=9)[0], tok, version=3, attention_mask=mask,
                        sample_ids=[s.sample_id for s in samples])
    key = next(iter(samples[0].sites))
    replaced = dataclasses.replace(samples[1], sites=other[1].sites)  # keeps ``source``: must not be trusted
    samples[2].sites[key] = other[2].sites[key]  # edited in place
    sent = [samples[0], replaced, samples[2], samples[3]]
    assert source_of(sent) is None
    got = _decode(_sync().encode(sent)).samples
    for a, b in zip(got, sent, strict=True):
        assert_samples_equal(a, b)
    assert torch.equal(payload_of(got[1].sites[key].record), payload_of(other[1].sites[key].record))


def test_mixed_layouts_and_per_tensor_amax_travel_as_separate_columns():
    a, *_ = _data("nvfp4", True)
    b, *_ = _data("mxfp4", False, seed=5)
    b = [dataclasses.replace(s, sample_id=s.sample_id + 10) for s in b]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    key = (0, "expert_fc1_in")
    c = split_batch({key: SiteGuidance(nvfp4.quantize(x).guidance(True), torch.ones(2, 5, dtype=torch.bool))},
                    torch.arange(10).view(2, 5), version=1, sample_ids=[50, 51])  # per-tensor amax: 0-dim
    sent = a + b + c
    msgs = _sync().encode(sent)
    cols = _head(msgs)["guidance"]["columns"]
    assert len(cols) == 2 * len(a[0].sites) + 1 and {c["meta"]["amax"] for c in cols} == {"row", None, "sample"}
    for got, want in zip(_decode(msgs).samples, sent, strict=True):
        assert_samples_equal(got, want)


def test_a_subset_of_a_split_is_gathered_from_its_columns():
    samples, routing, *_ = _data(B=5, lengths=(9, 8, 7, 1, 9))
    for part in (slice(1, None, 2), slice(2, None)):  # a second data-parallel rank's share (gather); a later chunk
        sub, sub_r = samples[part], routing[part]
        assert source_of(sub) is not None
        shard = _decode(_sync().encode(sub, sub_r))
        for a, b in zip(shard.samples, sub, strict=True):
            assert_samples_equal(a, b)
        _assert_routing_equal(shard.routing, sub_r)


def test_routing_only_and_guidance_only_chunks():
    samples, routing, *_ = _data()
    only_r = _decode(_sync().encode([], routing))
    assert only_r.samples == [] and len(only_r.routing) == len(routing)
    only_g = _decode(_sync().encode(samples))
    assert only_g.routing == [] and len(only_g.samples) == len(samples)
    assert _decode(_sync().encode([])).samples == []


def test_routing_of_other_samples_than_the_guidance_keeps_its_own_table():
    """A chunk whose routing covers other samples than its guidance (a sample with routing only, one with guidance
    only): each section's rows reach their own sample ids; only identical tables are sent once."""
    samples, routing, *_ = _data()
    for g, r in [(samples[:3], routing[1:]), (samples[1:], routing[:2]), (samples[::2], routing[1::2]),
                 (samples[:2], routing[::-1])]:
        shard = _decode(_sync().encode(g, r))
        for a, b in zip(shard.samples, g, strict=True):
            assert_samples_equal(a, b)
        by_id = {x.sample_id: x for x in r}  # in the chunk's sample order: the guidance's ids first, in its order
        gids = [s.sample_id for s in g]
        order = [i for i in gids if i in by_id] + [x.sample_id for x in r if x.sample_id not in gids]
        _assert_routing_equal(shard.routing, [by_id[i] for i in order])
    assert _head(_sync().encode(samples, routing))["routing"]["table"] is None  # the same samples: one table


def test_a_shard_of_several_chunks_gives_every_chunks_samples_and_routing_in_order():
    samples, routing, *_ = _data()
    shard = GuidanceShard()
    for g, r in [(samples[:1], routing[:1]), ([], routing[1:3]), (samples[1:], routing[3:])]:  # three chunks
        got = _decode(_sync().encode(g, r))
        shard.parts += got.parts
        shard.routing_parts += got.routing_parts
    assert len(shard.routing_parts) == 3 and len(shard.parts) == 2
    for a, b in zip(shard.samples, samples, strict=True):
        assert_samples_equal(a, b)
    _assert_routing_equal(shard.routing, routing)


def test_header_grows_per_sample_once_not_per_sample_and_site():
    def header(B, layers):
        batch, _, tok, mask = make_batch(B=B, S=6, layers=layers, lengths=[6] * B)
        return _sync().encode(split_batch(batch, tok, version=0, attention_mask=mask))[1].numel()

    per_sample_1 = (header(32, (0,)) - header(16, (0,))) / 16
    per_sample_4 = (header(32, (0, 1, 2, 3)) - header(16, (0, 1, 2, 3))) / 16
    # per sample: id, version, hash, tokens (~45 bytes); per extra column and sample < 1 byte (offset digits),
    # where a per-sample tensor table costs ~100 bytes per sample and site
    assert per_sample_1 < 80 and (per_sample_4 - per_sample_1) / 12 < 1


def test_every_corrupted_field_is_rejected_and_names_its_column():
    samples, routing, *_ = _data()
    msgs = _sync().encode(samples, routing)
    for sec in ("guidance", "routing"):
        for col in _head(msgs)[sec]["columns"]:
            name, _, shape, off, _ = col["fields"][-1]
            if torch.Size(shape).numel() == 0:
                continue
            bad = msgs[2].clone()
            bad[off] ^= 0x04
            with pytest.raises(GuidanceSyncError, match=f"{sec} checksum mismatch in column .* field {name}"):
                _decode([msgs[0], msgs[1], bad])
    bad = msgs[2].clone()
    bad[0] ^= 1
    _decode([msgs[0], msgs[1], bad], verify=False)  # verify=False trusts the transport


@pytest.mark.parametrize("edit,match", [
    (lambda h: h["guidance"]["columns"][0]["fields"][0].__setitem__(3, 8), "does not fit"),  # misaligned
    (lambda h: h["guidance"]["columns"][0]["fields"][0].__setitem__(3, 1 << 40), "does not fit"),
    (lambda h: h["guidance"]["columns"][0]["fields"][0].__setitem__(3, -16), "does not fit"),  # (audit, s56)
    (lambda h: h["guidance"]["columns"][0]["fields"][0].__setitem__(4, None), r"1 field\(s\) without a checksum"),
    (lambda h: h["guidance"]["table"].__setitem__("versions", [3, 3, 3]), "sample table columns differ in length"),
    (lambda h: next(f for f in h["guidance"]["columns"][0]["fields"] if f[0] == "valid").__setitem__(1, "uint8"),
     "field valid is torch.uint8, guidance carries torch.bool"),
    (lambda h: next(f for f in h["guidance"]["columns"][0]["fields"] if f[0] == "valid")[2].append(1),
     r"valid must be bool of shape \(9,\), got torch.bool \(9, 1\)"),  # same bytes, rows the record has not
    (lambda h: h["guidance"]["columns"][0].__setitem__("members", [0, 0, 1, 2]), "members"),
    (lambda h: h["guidance"]["columns"][0].__setitem__("members", [0, 1, 2, 9]), "members"),
    (lambda h: h["guidance"]["columns"][0].__setitem__("rows", [9, 7, 0, 6]), "does not fit"),
    (lambda h: h["guidance"]["columns"][0]["fields"].pop(0), "lack"),
    (lambda h: h["guidance"]["columns"][0]["fields"].pop(), "amax 'row' but fields"),
    (lambda h: h["guidance"]["columns"][0]["fields"][0].__setitem__(1, "complex64"), "complex64"),
    (lambda h: h["guidance"]["columns"][0]["meta"].__setitem__("fmt", "fp8"), "fp8"),
    (lambda h: h["guidance"]["table"].__setitem__("ids", [1, 1, 2, 3]), "duplicate"),
    # (audit, session 56) the bounds of the sample table and of a column's members and rows
    (lambda h: h["guidance"]["table"].__setitem__("ids", [True, 101, 102, 103]), "ids must be a list of ints"),
    (lambda h: h["guidance"]["table"].__setitem__("tokens", [9, 7, -1, 5]), "negative token counts"),
    (lambda h: h["guidance"]["columns"][0].__setitem__("members", [0, 1, 2, 4]), "members"),
    (lambda h: h["guidance"]["columns"][0].__setitem__("rows", [9, 7, 5]), "3 row counts for 4 members"),
    (lambda h: h["guidance"]["columns"][0].__setitem__("rows", [9, 7, -1, 6]), r"rows \[9, 7, -1, 6\]"),
    (lambda h: h["guidance"]["columns"][0]["meta"].__setitem__("shape", [64]), r"payload rows \(6,\) != \(8,\)"),
    (lambda h: h["guidance"]["columns"][0]["meta"].__setitem__("mode", "full"), r"payload rows \(6,\) != \(24,\)"),
    (lambda h: h["routing"].__setitem__("table", None) or h.__setitem__("guidance", None), "without a sample table"),
    # fields of a dtype their kind does not carry (a sender's bug): never cast or reinterpreted
    (lambda h: h["routing"]["columns"][0]["fields"][0].__setitem__(1, "float32"),
     "field experts is torch.float32, routing carries torch.uint8, torch.int16, torch.int32, torch.int64"),
    (lambda h: h["routing"]["columns"][0]["fields"][0].__setitem__(1, "bool"), "field experts is torch.bool"),
    (lambda h: h["guidance"]["columns"][0]["fields"][0].__setitem__(1, "int16"),
     "field payload is torch.int16, guidance carries torch.uint8"),
    # a negative dimension escaped as torch's RuntimeError: the receiver then did not read the transfer to its end
    (lambda h: h["guidance"]["columns"][0]["fields"][0][2].__setitem__(1, -6),
     r"field payload: shape \(\d+, -6\) has a negative dimension"),
    # (audit, session 59) a misspelt or missing section was read as absent: its samples' guidance or routing lost
    (lambda h: h.__setitem__("guidancf", h.pop("guidance")),
     r"the header has keys \['guidancf', 'protocol', 'routing'\], the protocol has \['guidance', 'protocol', "),
    (lambda h: h.pop("routing"), r"the header has keys \['guidance', 'protocol'\]"),
    (lambda h: h["routing"].__setitem__("tabel", h["routing"].pop("table")), r"the routing section has keys"),
    (lambda h: h["guidance"]["columns"][0].__setitem__("rowz", h["guidance"]["columns"][0].pop("rows")),
     r"a guidance column \(\[0, 'expert_fc1_in'\]\) has keys \['fields', 'key', 'members', 'meta', 'rowz'\]"),
    # a second column of a key holding the same samples replaced the first one's records (offsets intact)
    (lambda h: h["guidance"]["columns"][1].__setitem__("key", h["guidance"]["columns"][0]["key"]),
     r"guidance column \(0, 'expert_fc1_in'\) holds sample index\(es\) \[0, 1, 2, 3\] twice"),
    # a dtype name the protocol has not was a bare KeyError ("'Int64'"); the record's own checks name the column
    (lambda h: h["guidance"]["columns"][0]["fields"][0].__setitem__(1, "Uint8"),
     r"column \[0, 'expert_fc1_in'\] field payload: dtype 'Uint8' is not one of \['bool', 'float32'"),
    (lambda h: h["guidance"]["columns"][0]["meta"].__setitem__("amax", "rov"),
     r"column \[0, 'expert_fc1_in'\]: amax 'rov' is not None, 'row' or 'sample'"),
    (lambda h: next(f for f in h["guidance"]["columns"][1]["fields"] if f[0] == "expert_ids")[2].__setitem__(1, 2),
     r"column \[0, 'expert_fc2_in'\]: expert_ids must be integer of shape \(9, 3\)"),
])
def test_bad_headers_are_rejected_whole(edit, match):
    samples, routing, *_ = _data()
    msgs = _sync().encode(samples, routing)
    head = _head(msgs)
    edit(head)
    with pytest.raises(GuidanceSyncError, match=f"nothing applied: .*{match}"):
        _decode(_with_header(msgs, head))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("fmt,compact", FORMATS, ids=IDS)
def test_a_field_offset_moved_onto_other_bytes_or_a_longer_payload_is_refused_without_verify(fmt, compact, n):
    """(Audit, session 59.) Offsets follow from the shapes (``wire.layout``): a field moved by a multiple of the
    alignment (a bit flipped in transit; ``verify=False`` has no header checksum) was in bounds and read another
    field's or its own neighbours' bytes as its rows, accepted. Every moved offset is refused, naming the field and
    where the layout puts it; so is a payload longer than its fields."""
    samples, routing, *_ = _data(fmt, compact, B=n, lengths=(9, 7, 5)[:n])
    msgs = _sync(verify=False).encode(samples, routing)
    head = _head(msgs)
    fields = [f for sec in ("guidance", "routing") for c in head[sec]["columns"] for f in c["fields"]]
    size = msgs[2].numel()
    for i, f in enumerate(fields):
        moved = {f[3] + d for d in (-32, -16, 16, 32)} | {f[3] ^ (1 << b) for b in range(4, size.bit_length())}
        for off in sorted(o for o in moved if 0 <= o < size):
            edited = _head(msgs)
            [g for sec in ("guidance", "routing") for c in edited[sec]["columns"] for g in c["fields"]][i][3] = off
            with pytest.raises(GuidanceSyncError, match=rf"field {f[0]}: offset {off}, the layout puts it at {f[3]} "
                                                        r"|field \w+: shape .* does not fit"):
                _decode(_with_header(msgs, edited, crc=False), verify=False)
    longer = torch.cat([msgs[2], torch.zeros(16, dtype=torch.uint8)])
    with pytest.raises(GuidanceSyncError, match=rf"payload of {size + 16} bytes, its fields end at byte {size}"):
        _decode([msgs[0], msgs[1], longer], verify=False)
    for a, b in zip(_decode(msgs, verify=False).samples, samples, strict=True):
        assert_samples_equal(a, b)


def test_a_header_changed_on_the_way_is_rejected_with_verify():
    """The header says which layer, site and sample each field is: a layer number changed in transit (fields and
    their checksums intact) would guide another layer. Its CRC-32 travels in the size message."""
    samples, routing, *_ = _data()
    msgs = _sync().encode(samples, routing)
    head = _head(msgs)
    layer = head["guidance"]["columns"][0]["key"][0]
    head["guidance"]["columns"][0]["key"][0] = layer + 1
    with pytest.raises(GuidanceSyncError, match="nothing applied: header checksum mismatch"):
        _decode(_with_header(msgs, head, crc=False))
    got = _decode(_with_header(msgs, head, crc=False), verify=False)  # verify=False trusts the transport
    assert got.parts[0].columns[0].key[0] == layer + 1
    unchecked = _sync(verify=False).encode(samples, routing)
    assert int(unchecked[0][5]) == -1
    with pytest.raises(GuidanceSyncError, match="the header has no checksum: the sender runs verify=False"):
        _decode(unchecked)
    both = _decode(unchecked, verify=False)  # verify=False on both sides: the fields carry no checksum either
    for a, b in zip(both.samples, samples, strict=True):
        assert_samples_equal(a, b)
    _assert_routing_equal(both.routing, routing)


@pytest.mark.parametrize("head,match", [([PROTOCOL], "a JSON list, not an object"),
                                        ({"protocol": PROTOCOL, "guidance": [1]}, "nothing applied")])
def test_a_header_of_the_wrong_structure_is_rejected(head, match):
    msgs = _sync().encode(*_data()[:2])
    with pytest.raises(GuidanceSyncError, match=match):
        _decode(_with_header(msgs, head))


# ---- assembly from columns == records.assemble / routing.assemble_routing -----------------------------------
def _assert_same_batch(o1: dict, o2: dict):
    assert list(o1) == list(o2)
    for k in o1:
        x, y = o1[k], o2[k]
        assert type(x.record) is type(y.record) and x.record.shape == y.record.shape and x.record.fmt == y.record.fmt
        for u, v in [(payload_of(x.record), payload_of(y.record)), (x.valid, y.valid), (x.expert_ids, y.expert_ids),
                     (x.record.block_scales.view(torch.uint8), y.record.block_scales.view(torch.uint8)),
                     (x.record.global_amax, y.record.global_amax)]:
            assert (u is None and v is None) or (u.dtype == v.dtype and torch.equal(u, v)), k


def _both(parts_samples, shard, ids, tok, mask, versions, keys=None):
    by_id = {s.sample_id: s for s in parts_samples}
    c1, c2 = FallbackCounter(), FallbackCounter()
    o1 = assemble([by_id.get(i) if i is not None else None for i in ids], tok, versions=versions, counter=c1,
                  attention_mask=mask, keys=keys)
    o2 = shard.assemble(ids, tok, versions=versions, counter=c2, attention_mask=mask, keys=keys)
    _assert_same_batch(o1, o2)
    assert (c1.used, c1.fallback) == (c2.used, c2.fallback)
    return c2


@pytest.mark.parametrize("fmt,compact", FORMATS, ids=IDS)
def test_assemble_from_columns_equals_assemble(fmt, compact):
    samples, _, tok, mask, _ = _data(fmt, compact, lengths=(9, 7, 3, 5), left_pad=True)
    shard = GuidanceShard()  # two chunks: two parts
    for part in (samples[:1], samples[1:]):
        shard.parts += _decode(_sync().encode(part)).parts
    ids = [s.sample_id for s in samples]
    assert _both(samples, shard, ids, tok, mask, 3).coverage == 1.0
    # rows permuted, one without a sample, one sample twice; row 0's tokens edited; row 3 from an older version
    rows = [2, 0, None, 2]
    t = torch.stack([tok[r if r is not None else 1] for r in rows])
    m = torch.stack([mask[r if r is not None else 1] for r in rows])
    t[1, m[1].nonzero()[0, 0]] += 1
    c = _both(samples, shard, [ids[r] if r is not None else None for r in rows], t, m, [3, 3, 3, 4])
    assert set(c.fallback) == {"token_hash", "missing", "version"} and c.used > 0
    _both(samples, shard, ids, tok, mask, 3, keys=[(2, "kv_k"), (7, "kv_v"), (0, "expert_fc2_in")])


def test_assemble_from_columns_counts_shape_and_unrecorded_rows():
    batch, _, tok, mask = make_batch(B=3, lengths=[9, 9, 9], sites=("expert_fc1_in",), layers=(0,))
    key = (0, "expert_fc1_in")
    v = batch[key].valid.clone()
    v[0, 4] = False  # a row the rollout did not record
    samples = split_batch({key: SiteGuidance(batch[key].record, v)}, tok, version=0, attention_mask=mask)
    other, _, _, _ = make_batch(B=3, lengths=[9, 9, 9], sites=("expert_fc1_in",), layers=(0,), compact=False)
    full = split_batch(other, tok, version=0, attention_mask=mask)[1]  # a full record among compact ones
    sent = [samples[0], full, samples[2]]
    shard = _decode(_sync().encode(sent))
    c = _both(sent, shard, [0, 1, 2], tok, mask, 0)
    assert c.fallback == {"shape": 9, "not_recorded": 1} and c.used == 17


def test_a_sample_with_fewer_rows_than_tokens_is_a_shape_mismatch_on_both_paths():
    """A sample whose record holds 8 rows for its 9 tokens (token hash and version right) is refused whole and
    counted as ``shape``, from columns as from samples: its rows would land on the wrong tokens."""
    from megatron_trace.guidance.records import SiteRecord
    from megatron_trace.rollout.recorder import map_record

    batch, _, tok, mask = make_batch(B=3, lengths=[9, 9, 9], sites=("expert_fc1_in",), layers=(0,))
    key = (0, "expert_fc1_in")
    samples = split_batch(batch, tok, version=0, attention_mask=mask)
    r = samples[1].sites[key]
    short = SiteRecord(map_record(r.record, lambda t: t[:8] if t.dim() else t, (8, *r.record.shape[1:])), r.valid[:8])
    samples[1] = dataclasses.replace(samples[1], sites={key: short})
    c = _both(samples, _decode(_sync().encode(samples)), [0, 1, 2], tok, mask, 0)
    assert c.fallback == {"shape": 9} and c.used == 18


def test_a_sample_in_two_received_chunks_is_refused_by_name():
    """Which chunk's rows a row would take is undefined: the shard refuses to guess."""
    batch, _, tok, mask = make_batch(B=2, lengths=[9, 9], sites=("expert_fc1_in",), layers=(0,))
    samples = split_batch(batch, tok, version=0, attention_mask=mask)
    shard = GuidanceShard()
    shard.parts += _decode(_sync().encode(samples)).parts + _decode(_sync().encode(samples[1:])).parts
    with pytest.raises(ValueError, match="sample 1 appears in two received chunks"):
        shard.assemble([0, 1], tok, versions=0, counter=FallbackCounter(), attention_mask=mask)


def test_assemble_routing_from_columns_equals_and_raises_on_mismatch():
    samples, routing, tok, mask, _ = _data(lengths=(9, 7, 3, 5))
    shard = _decode(_sync().encode(samples, routing))
    ids = [r.sample_id for r in routing]
    want = assemble_routing(routing, tok, versions=3, attention_mask=mask)
    got = shard.assemble_routing(ids, tok, versions=3, attention_mask=mask)
    assert list(want) == list(got) and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(RoutingMismatchError, match="batch row 1: missing"):
        shard.assemble_routing([ids[0], None, ids[2], ids[3]], tok, versions=3, attention_mask=mask)
    with pytest.raises(RoutingMismatchError, match="has version 3, the trainer expects 4"):
        shard.assemble_routing(ids, tok, versions=4, attention_mask=mask)
    t = tok.clone()
    t[2, 0] += 1
    with pytest.raises(RoutingMismatchError, match="batch row 2: .*token_hash"):
        shard.assemble_routing(ids, t, versions=3, attention_mask=mask)


def test_assembly_from_columns_takes_lengths_as_records_assemble_does():
    """Right-padded rows described by ``lengths`` (no mask): the same batch, counts and routing on both paths."""
    lengths = [9, 7, 3, 5]
    samples, routing, tok, _, _ = _data(lengths=tuple(lengths))
    shard = _decode(_sync().encode(samples, routing))
    ids = [s.sample_id for s in samples]
    c1, c2 = FallbackCounter(), FallbackCounter()
    o1 = assemble(samples, tok, versions=3, counter=c1, lengths=lengths)
    _assert_same_batch(o1, shard.assemble(ids, tok, versions=3, counter=c2, lengths=lengths))
    assert (c1.used, c1.fallback) == (c2.used, c2.fallback) and c2.coverage == 1.0, (c1, c2)
    want = assemble_routing(routing, tok, versions=3, lengths=lengths)
    got = shard.assemble_routing(ids, tok, versions=3, lengths=lengths)
    assert list(want) == list(got) and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, None), (torch.bool, None), (torch.int8, None),
                                         (torch.int64, "1-D")])
def test_routing_of_another_dtype_or_shape_is_refused_by_name(dtype, shape):
    """Float or bool expert ids were sent and replayed truncated to int64 (1.5 -> 1), int8 ones failed in the
    sender with "KeyError: torch.int8", 1-D ones in the trainer's assembly: ``SampleRouting`` names them."""
    from megatron_trace.guidance.routing import SampleRouting

    r = _data()[1][0]
    experts = {k: v.to(dtype) for k, v in r.experts.items()}
    if shape:
        experts = {k: v[:, 0] for k, v in experts.items()}
    with pytest.raises(ValueError, match=f"routing of sample {r.sample_id} layer 0: expert ids {dtype} "
                                         r"\(\d+(, 3)?,?\) must be \[tokens, topk\] of torch.uint8"):
        SampleRouting(r.sample_id, r.version, r.token_hash, r.num_tokens, experts)
    if not shape and dtype != torch.int64:
        return
    ok = SampleRouting(r.sample_id, r.version, r.token_hash, r.num_tokens, {k: v.long() for k, v in r.experts.items()})
    _assert_routing_equal(_decode(_sync().encode([], [ok])).routing, [ok])  # int64 ids travel as they are


def test_a_sample_whose_site_is_not_a_record_is_refused_by_the_sender():
    samples = _data()[0]
    s = samples[1]
    key = next(iter(s.sites))
    bad = dataclasses.replace(s, sites={**s.sites, key: None}, source=None)
    with pytest.raises(ValueError, match=re.escape(f"sample {s.sample_id} site {key}: NoneType is not a SiteRecord")):
        _sync().encode([samples[0], bad])


def _per_tensor_amax_samples(n=4):
    """``n`` samples at one key, each its own per-tensor amax (0-dim, all different) and token count (3 + i); sent
    together they form one column whose ``amax`` field holds one value per member."""
    key, out = (0, "expert_fc1_in"), []
    for i in range(n):
        x = torch.randn(1, 3 + i, 32, generator=torch.Generator().manual_seed(i)) * (i + 1)
        sg = SiteGuidance(nvfp4.quantize(x).guidance(True), torch.ones(1, 3 + i, dtype=torch.bool))
        out += split_batch({key: sg}, torch.arange(1, 4 + i).view(1, -1) + 10 * i, version=1, sample_ids=[60 + i])
    assert len({float(s.sites[key].record.global_amax) for s in out}) == n
    return out, key


def test_per_tensor_amaxes_of_a_non_consecutive_subset_of_received_columns_travel_with_their_samples():
    samples, key = _per_tensor_amax_samples()
    received = _decode(_sync().encode(samples)).samples  # views of one column, amax [4]
    assert source_of(received) is not None and _head(_sync().encode(samples))["guidance"]["columns"][0]["meta"][
        "amax"] == "sample"
    sub = received[0::2]  # members 0 and 2: gathered, not sliced
    for got, want in zip(_decode(_sync().encode(sub)).samples, samples[0::2], strict=True):
        assert_samples_equal(got, want)
        assert float(got.sites[key].record.global_amax) == float(want.sites[key].record.global_amax)


def test_per_tensor_amaxes_reach_their_own_rows_when_columns_are_assembled_in_another_order():
    samples, key = _per_tensor_amax_samples()
    shard = _decode(_sync().encode(samples))
    rows = [3, 1, 0, 2]  # batch row b trains sample rows[b]
    S = 6
    tok = torch.zeros(4, S, dtype=torch.int64)
    for b, i in enumerate(rows):
        tok[b, : 3 + i] = torch.arange(1, 4 + i) + 10 * i
    mask = tok != 0
    c = _both(samples, shard, [60 + i for i in rows], tok, mask, 1)
    assert c.coverage == 1.0
    amax = shard.assemble([60 + i for i in rows], tok, versions=1, counter=FallbackCounter(),
                          attention_mask=mask)[key].record.global_amax
    for b, i in enumerate(rows):
        assert (amax[b, : 3 + i] == samples[i].sites[key].record.global_amax).all()


def test_a_record_of_another_format_with_the_same_shapes_is_a_layout_mismatch():
    """An NVFP4 record without an amax has the shapes of an ``sglang_kvfp4`` record (block 16, uint8 scales): only
    the format tells their scale bytes (E4M3 / E8M0) apart. Assembled with the majority, its bytes would be read as
    the other format's scales: it is counted ``shape``, on both assembly paths."""
    from megatron_trace.formats import sglang_kvfp4

    key = (0, "kv_k")
    x = torch.randn(3, 5, 2, 32, generator=torch.Generator().manual_seed(0))
    tok = torch.arange(1, 16).view(3, 5)
    valid = torch.ones(3, 5, dtype=torch.bool)
    sgl = split_batch({key: SiteGuidance(sglang_kvfp4.quantize(x).guidance(True), valid)}, tok, version=0)
    nv = nvfp4.quantize(x[2:], per_row=True).guidance(True)
    nv = SiteGuidance(dataclasses.replace(nv, global_amax=None), valid[2:])
    sent = sgl[:2] + split_batch({key: nv}, tok[2:], version=0, sample_ids=[2])
    c = _both(sent, _decode(_sync().encode(sent)), [0, 1, 2], tok, torch.ones(3, 5, dtype=torch.bool), 0)
    assert c.fallback == {"shape": 5} and c.used == 10


def test_a_tie_between_layouts_goes_to_the_earliest_row_on_both_assembly_paths():
    """One compact and one full record at a key (1:1): the layout of the earliest batch row is the batch's, whatever
    order the chunks holding them arrived in; the other row is counted ``shape``."""
    key = (0, "expert_fc1_in")
    batch, _, tok, mask = make_batch(B=2, lengths=[9, 9], sites=("expert_fc1_in",), layers=(0,))
    other, *_ = make_batch(B=2, lengths=[9, 9], sites=("expert_fc1_in",), layers=(0,), compact=False)
    compact = split_batch(batch, tok, version=0, attention_mask=mask)[0]
    full = split_batch(other, tok, version=0, attention_mask=mask)[1]
    shard = GuidanceShard()
    for s in (compact, full):  # the compact record's chunk first
        shard.parts += _decode(_sync().encode([s])).parts
    rows = [1, 0]  # ... but the full record's sample on the first batch row
    c = _both([compact, full], shard, rows, tok[rows], mask[rows], 0)
    assert c.fallback == {"shape": 9} and c.used == 9
    out = shard.assemble(rows, tok[rows], versions=0, counter=FallbackCounter(), attention_mask=mask[rows])[key]
    assert not out.compact and out.valid[0].all() and not out.valid[1].any()


# ---- audit (session 56): what a mutation run of the record formats found untested -------------------------
def _one_site(width: int, ids=(0, 1, 2), expert_ids: bool = False, seed: int = 0):
    """Three 5-token samples at one key, NVFP4 compact rows of ``width`` elements (per-row amax); ``expert_ids``:
    one int64 id per row as well."""
    key = (0, "expert_fc1_in")
    tok = torch.arange(1, 16).view(3, 5)
    x = torch.randn(3, 5, width, generator=torch.Generator().manual_seed(seed))
    e = torch.arange(15).view(3, 5) % 4 if expert_ids else None
    sg = SiteGuidance(nvfp4.quantize(x, per_row=True).guidance(True), torch.ones(3, 5, dtype=torch.bool), e)
    return split_batch({key: sg}, tok, version=0, sample_ids=list(ids)), tok, key


@pytest.mark.parametrize("odd", ["wider_rows", "expert_ids", "no_amax"])
def test_a_record_whose_rows_differ_only_in_shape_or_expert_ids_is_a_layout_mismatch(odd):
    """Rows of 40 and of 48 elements both pack into three 16-element blocks (equal payload and scales widths), and
    a record with expert ids per row has the valid mask of one without, an NVFP4 record without its amax the
    payload and scales of one with: only the row shape / the ids / the amax tell them apart. The odd sample is
    counted ``shape`` on both assembly paths, not assembled into the majority's rows."""
    base, tok, key = _one_site(40)
    other = _one_site(48 if odd == "wider_rows" else 40, expert_ids=odd == "expert_ids", seed=1)[0]
    if odd == "no_amax":  # an NVFP4 record without its amax: assembled, its rows would be read with amax 0
        r = other[1].sites[key]
        other[1] = dataclasses.replace(other[1], sites={key: SiteRecord(dataclasses.replace(r.record, global_amax=None),
                                                                        r.valid)}, source=None)
    sent = [base[0], other[1], base[2]]
    mask = torch.ones(3, 5, dtype=torch.bool)
    c = _both(sent, _decode(_sync().encode(sent)), [0, 1, 2], tok, mask, 0)
    assert c.fallback == {"shape": 5} and c.used == 10
    out = assemble(sent, tok, versions=0, counter=FallbackCounter())[key]
    assert out.record.shape == (3, 5, 40) and out.expert_ids is None and not out.valid[1].any()


@pytest.mark.parametrize("pick", [slice(1, 3), slice(None)], ids=["a_run", "all"])
def test_per_tensor_amaxes_of_a_consecutive_run_of_received_columns_travel_with_their_samples(pick):
    """Consecutive members are sent as slices of the columns (amax: one value per member), not gathers."""
    samples, key = _per_tensor_amax_samples()
    received = _decode(_sync().encode(samples)).samples
    assert source_of(received[pick]) is not None
    for got, want in zip(_decode(_sync().encode(received[pick])).samples, samples[pick], strict=True):
        assert_samples_equal(got, want)
        assert float(got.sites[key].record.global_amax) == float(want.sites[key].record.global_amax)


def test_the_sender_refuses_routing_ids_of_another_dtype_put_in_after_construction():
    """``SampleRouting.experts`` is a mutable dict: float ids put in after the constructor's check are refused by the
    sender, by name (not sent as float32 for the receiver to refuse, nor cast)."""
    r = _data()[1][1]
    r.experts[0] = r.experts[0].float()
    with pytest.raises(ValueError, match=re.escape(f"routing of sample {r.sample_id} at 0: field experts is "
                                                   "torch.float32, routing carries torch.uint8")):
        _sync().encode([], [r])


def test_a_chunk_whose_samples_hold_different_sites_round_trips():
    """Columns of all samples at their token counts share one (members, row starts) pair on decode; a column of
    fewer members (a sample whose site was deleted after the split) has its own, whatever came before it."""
    samples, _, tok, mask, _ = _data()
    key = sorted(samples[1].sites)[-1]
    del samples[1].sites[key]  # in place: ``source`` still points at the split's columns, which hold the site
    sent = samples
    assert source_of(sent) is None
    msgs = _sync().encode(sent)
    cols = _head(msgs)["guidance"]["columns"]
    assert cols[0]["members"] is None and cols[-1]["members"] == [0, 2, 3] and cols[-1]["key"] == list(key)
    shard = _decode(msgs)
    for got, want in zip(shard.samples, sent, strict=True):
        assert_samples_equal(got, want)
    c = _both(sent, shard, [s.sample_id for s in sent], tok, mask, 3)  # its tokens count missing at that key
    assert c.fallback == {"missing": samples[1].num_tokens} and key[1] == "kv_v"


def test_the_byte_counts_of_received_columns_equal_the_samples_own():
    """``sample_nbytes`` / ``guidance_nbytes`` (what the cache accounts) from the column shapes, per-tensor amaxes
    (one float32 per member) included, equal the per-sample sums."""
    for samples in (_per_tensor_amax_samples()[0], _data()[0]):
        part = _decode(_sync().encode(samples)).parts[0]
        assert part.sample_nbytes == [s.nbytes() for s in samples]
        assert part.guidance_nbytes() == sum(s.guidance_nbytes() for s in samples)


def test_split_columns_and_chunks_do_not_depend_on_the_order_the_recorder_met_the_sites_in():
    from megatron_trace.guidance.records import pack_guidance

    batch, _, tok, mask = make_batch(B=3, lengths=[9, 7, 5])
    packs = [pack_guidance(b, tok, version=0, attention_mask=mask) for b in (batch, dict(reversed(batch.items())))]
    assert [c.key for c in packs[0].columns] == [c.key for c in packs[1].columns] == sorted(batch)
    a, b = (_sync().encode(p.to_samples()) for p in packs)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_routing_from_columns_of_a_sample_without_a_layer_the_others_have_raises():
    """Its rows at that layer would replay expert 0 (the zero fill) for every token."""
    samples, routing, tok, mask, _ = _data(lengths=(9, 7, 3, 5))
    del routing[1].experts[2]
    shard = _decode(_sync().encode(samples, routing))
    ids = [r.sample_id for r in routing]
    with pytest.raises(RoutingMismatchError, match=re.escape("routing for batch row 1: layers [0] != [0, 2] of the "
                                                             "other samples")):
        shard.assemble_routing(ids, tok, versions=3, attention_mask=mask)


def test_routing_from_columns_with_rows_other_than_tokens_or_another_top_k_raises_by_name():
    samples, routing, tok, mask, _ = _data(lengths=(9, 7, 3, 5))
    ids = [r.sample_id for r in routing]
    msgs = _sync().encode([], routing)
    head = _head(msgs)
    head["routing"]["columns"][0]["rows"] = [8, 8, 3, 5]  # the same total: the chunk decodes
    with pytest.raises(RoutingMismatchError, match=re.escape("routing for batch row 0: layer 0 has 8 rows for 9 "
                                                             "tokens")):
        _decode(_with_header(msgs, head)).assemble_routing(ids, tok, versions=3, attention_mask=mask)
    top2 = split_routing({layer: torch.randint(0, 8, (4, tok.shape[1], 2)) for layer in (0, 2)}, tok, version=3,
                         num_experts=8, attention_mask=mask, sample_ids=ids)
    shard = GuidanceShard()
    for part in (routing[:2], top2[2:]):
        shard.routing_parts += _decode(_sync().encode([], part)).routing_parts
    with pytest.raises(RoutingMismatchError, match=re.escape("routing layer 0: top-k 2 != 3")):
        shard.assemble_routing(ids, tok, versions=3, attention_mask=mask)


def test_assembly_from_columns_refuses_a_sample_id_list_of_another_length_than_the_batch():
    from megatron_trace.guidance.packed_assemble import assemble_packed, assemble_routing_packed

    samples, routing, tok, mask, _ = _data(lengths=(9, 7, 3, 5))
    shard = _decode(_sync().encode(samples, routing))
    for ids in ([100, 101, 102], [100, 101, 102, 103, None]):
        with pytest.raises(ValueError, match=f"{len(ids)} sample ids for a batch of 4 rows"):
            assemble_packed(shard.parts, ids, tok, versions=3, counter=FallbackCounter(), attention_mask=mask)
        with pytest.raises(ValueError, match=f"{len(ids)} routing sample ids for a batch of 4 rows"):
            assemble_routing_packed(shard.routing_parts, ids, tok, versions=3, attention_mask=mask)
