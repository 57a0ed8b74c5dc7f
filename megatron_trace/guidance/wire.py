"""Columnar wire format of ``GuidanceSync`` (protocol 6): one chunk's samples as columns, not per-sample tensors.

Header (JSON), per section ``guidance`` and ``routing`` (absent when the chunk has none of it):

  table     {"ids", "versions", "hashes", "tokens"}: one entry per sample of the section (routing: null when
            equal to the guidance table)
  columns   [{"key": [layer, site] | layer, "meta": {mode, fmt, shape, amax} | {}, "members": sample indices
            (null: all), "rows": rows per member (null: its token count), "fields": [[name, dtype, shape,
            offset, crc32 or null]]}]

Payload: every column field is one contiguous tensor (its members' rows back to back) at a 16-byte aligned
offset; gaps are zero. The sender fills a field with one ``index_select`` from the columns its samples are
views of (``split_batch``/``split_routing`` output), else one ``torch.cat`` of the samples' own tensors; the
receiver turns fields into views of the payload (no per-sample work) and checks every size, offset (each field
where the layout puts it, the payload ending with the last field), the header's keys and, with ``verify``, every
field's CRC-32 before anything is returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from .packed import Column, PackedGuidance, PackedRouting, SampleTable, _Packed, column_meta, site_fields, source_of
from .records import SiteRecord
from .serial import ALIGN, RecordFormatError, check_widths, checksums

DTYPES = {"uint8": torch.uint8, "bool": torch.bool, "int16": torch.int16, "int32": torch.int32,
          "int64": torch.int64, "float32": torch.float32}
_NAMES = {v: k for k, v in DTYPES.items()}
_REQUIRED = {"guidance": {"payload", "scales", "valid"}, "routing": {"experts"}}
_FIELD_DTYPES = {  # what each column field may be (both ends check: a wrong dtype is never cast or reinterpreted)
    "guidance": {"payload": (torch.uint8,), "scales": (torch.uint8,), "valid": (torch.bool,),
                 "amax": (torch.float32,), "expert_ids": (torch.int64,)},
    "routing": {"experts": (torch.uint8, torch.int16, torch.int32, torch.int64)},
}


def _check_dtype(kind: str, name: str, dtype: torch.dtype, where: str, error=ValueError) -> None:
    allowed = _FIELD_DTYPES[kind].get(name)
    if allowed is None:
        raise error(f"{where}: field {name!r} is not a {kind} field {sorted(_FIELD_DTYPES[kind])}")
    if dtype not in allowed:
        raise error(f"{where}: field {name} is {dtype}, {kind} carries {', '.join(map(str, allowed))}")


@dataclass
class FieldPlan:
    """One column field of a chunk: where it goes in the payload and how to fill it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: Callable[[torch.Tensor], None]  # writes the field into a tensor of ``shape`` and ``dtype``
    device: torch.device  # where the field's source tensors live
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class SectionPlan:
    head: dict  # this section's header (offsets and checksums filled in by ``layout`` / the sender)
    fields: list[FieldPlan]


def _table(samples) -> SampleTable:
    return SampleTable([int(s.sample_id) for s in samples], [int(s.version) for s in samples],
                       [str(s.token_hash) for s in samples], [int(s.num_tokens) for s in samples])


def _select(t: torch.Tensor, idx: torch.Tensor | slice) -> Callable[[torch.Tensor], None]:
    def fill(out: torch.Tensor) -> None:
        if isinstance(idx, slice):  # consecutive rows: one plain copy
            out.copy_(t[idx])
        elif out.device == t.device:
            torch.index_select(t, 0, idx, out=out)
        else:
            out.copy_(t.index_select(0, idx))
    return fill


def _cat(parts: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    def fill(out: torch.Tensor) -> None:
        if all(p.device == out.device for p in parts):
            torch.cat(parts, out=out)
        else:
            out.copy_(torch.cat([p.to(out.device) for p in parts]))
    return fill


def _column_head(key, meta, members, rows, table, n) -> dict:
    own = [table.tokens[i] for i in members]
    return {"key": list(key) if isinstance(key, tuple) else key, "meta": meta,
            "members": None if len(members) == n else members, "rows": None if rows == own else rows, "fields": []}


def _selection(c: Column, mem: dict[int, int], idx: list[int]) -> tuple[list[int], list[int], list[int], dict]:
    """(chunk sample indices, member positions, rows per member, row index per device: filled lazily)."""
    js = [(k, mem[i]) for k, i in enumerate(idx) if i in mem]
    pos = [j for _, j in js]
    return [k for k, _ in js], pos, [c.starts[j + 1] - c.starts[j] for j in pos], {}


def _from_source(packed: _Packed, idx: list[int], table: SampleTable) -> SectionPlan:
    """Columns of ``packed`` restricted to its samples ``idx`` (chunk order): one index_select per field."""
    head, plans, shared = [], [], {}
    for c, mem in zip(packed.columns, packed.membership):
        # columns of one split share members and starts: their selection is computed once
        members, pos, rows, row_idx = shared.get((id(c.members), id(c.starts))) or _selection(c, mem, idx)
        shared[(id(c.members), id(c.starts))] = members, pos, rows, row_idx
        if not members:
            continue
        col = _column_head(c.key, c.meta, members, rows, table, len(idx))
        run = pos == list(range(pos[0], pos[0] + len(pos)))  # consecutive members: slices, not gathers
        for name, t in c.fields.items():
            if name == "amax" and c.meta.get("amax") == "sample":
                sel = slice(pos[0], pos[-1] + 1) if run else torch.as_tensor(pos, dtype=torch.int64, device=t.device)
            elif run:
                sel = slice(c.starts[pos[0]], c.starts[pos[-1] + 1])
            else:
                sel = row_idx.get(t.device)
                if sel is None:
                    sel = row_idx[t.device] = c.row_index(pos, t.device)
            n = sel.stop - sel.start if isinstance(sel, slice) else sel.numel()
            col["fields"].append([name, _NAMES[t.dtype], [n, *t.shape[1:]], 0, None])
            plans.append(FieldPlan(t.dtype, (n, *t.shape[1:]), _select(t, sel), t.device))
        head.append(col)
    return SectionPlan({"columns": head}, plans)


def _from_samples(parts_of, samples, table: SampleTable, kind: str) -> SectionPlan:
    """Columns grouped by (key, layout) from each sample's own tensors: one cat per field."""
    groups: dict[tuple, tuple[dict, list[int], list[int], list[dict]]] = {}
    for k, s in enumerate(samples):
        for key, meta, fields in parts_of(s):
            rows = next(t.shape[0] for n, t in fields.items() if n != "amax" or meta.get("amax") != "sample")
            sig = (key, repr(meta), tuple((n, t.dtype, tuple(t.shape[1:])) for n, t in fields.items()))
            if sig not in groups:  # a new layout: its field dtypes checked once
                for n, t in fields.items():
                    _check_dtype(kind, n, t.dtype, f"{kind} of sample {s.sample_id} at {key}")
            g = groups.setdefault(sig, (meta, [], [], []))
            g[1].append(k)
            g[2].append(int(rows))
            g[3].append(fields)
    head, plans = [], []
    for (key, _, sig_fields), (meta, members, rows, fields) in groups.items():
        col = _column_head(key, meta, members, rows, table, len(samples))
        for name, dtype, tail in sig_fields:
            parts = [f[name] for f in fields]
            shape = (sum(p.shape[0] for p in parts), *tail)
            col["fields"].append([name, _NAMES[dtype], list(shape), 0, None])
            plans.append(FieldPlan(dtype, shape, _cat(parts), parts[0].device))
        head.append(col)
    return SectionPlan({"columns": head}, plans)


def check_sites(s) -> None:
    """Every site of sample ``s`` holds a ``SiteRecord`` (its ``sites`` dict is mutable: checked where it is sent)."""
    bad = next((k for k, rec in s.sites.items() if not isinstance(rec, SiteRecord)), None)
    if bad is not None:
        raise ValueError(f"sample {s.sample_id} site {bad}: {type(s.sites[bad]).__name__} is not a SiteRecord")


def _guidance_parts(s):
    check_sites(s)
    return [(key, column_meta(rec), site_fields(rec)) for key, rec in s.sites.items()]


def _routing_parts(s):
    return [(layer, {}, {"experts": t}) for layer, t in sorted(s.experts.items())]


def plan_section(samples: Sequence, kind: str) -> SectionPlan | None:
    """The columns of ``samples`` (``SampleGuidance`` for kind "guidance", ``SampleRouting`` for "routing")."""
    if not samples:
        return None
    table = _table(samples)
    src = source_of(samples)
    plan = (_from_source(src[0], src[1], table) if src is not None
            else _from_samples(_guidance_parts if kind == "guidance" else _routing_parts, samples, table, kind))
    plan.head["table"] = table.as_dict()
    return plan


def layout(sections: Sequence[SectionPlan | None]) -> int:
    """Assign aligned payload offsets to every field (in header order); returns the payload size."""
    off, end = 0, 0
    for sec in sections:
        if sec is None:
            continue
        heads = (f for c in sec.head["columns"] for f in c["fields"])
        for plan, fhead in zip(sec.fields, heads):
            plan.offset = fhead[3] = off
            end = off + plan.nbytes
            off = -(-end // ALIGN) * ALIGN
    return end


def write(sections: Sequence[SectionPlan | None], payload: torch.Tensor) -> None:
    """Fill the payload: each field in place, padding gaps zeroed."""
    pos = 0
    for sec in sections:
        for p in sec.fields if sec is not None else ():
            if p.offset > pos:
                payload[pos : p.offset].zero_()
            if p.nbytes:
                p.fill(payload[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape))
            pos = p.offset + p.nbytes


def add_field_checksums(sections: Sequence[SectionPlan | None], payload: torch.Tensor) -> None:
    """CRC-32 of every field into the header (a device payload is read back once)."""
    host = payload if payload.device.type == "cpu" else payload.cpu()
    heads = [f for sec in sections if sec is not None for c in sec.head["columns"] for f in c["fields"]]
    spans = [host[f[3] : f[3] + math.prod(f[2]) * DTYPES[f[1]].itemsize] for f in heads]
    for f, crc in zip(heads, checksums(spans)):
        f[4] = crc


# ---- receiver ---------------------------------------------------------------------------------------------
_KEYS = {"head": {"protocol", "guidance", "routing"}, "section": {"table", "columns"},
         "table": {"ids", "versions", "hashes", "tokens"}, "column": {"key", "meta", "members", "rows", "fields"}}
_META_KEYS = {"guidance": {"mode", "fmt", "shape", "amax"}, "routing": set()}


def _keys(d, want: set, what: str) -> dict:
    """``d`` when it is a dict of exactly the keys ``want`` (a misspelt section was read as absent: samples lost)."""
    if not isinstance(d, dict) or d.keys() != want:
        got = sorted(map(str, d)) if isinstance(d, dict) else f"a JSON {type(d).__name__}"
        raise RecordFormatError(f"{what} has keys {got}, the protocol has {sorted(want)}")
    return d


def _ints(x, what: str) -> list[int]:
    if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise RecordFormatError(f"{what} must be a list of ints, got {str(x)[:80]}")
    return x


def _decode_table(d: dict) -> SampleTable:
    _keys(d, _KEYS["table"], "the sample table")
    t = SampleTable(_ints(d["ids"], "ids"), _ints(d["versions"], "versions"), list(map(str, d["hashes"])),
                    _ints(d["tokens"], "tokens"))
    if len(set(t.ids)) != len(t.ids) or any(n < 0 for n in t.tokens):
        raise RecordFormatError("sample table has duplicate ids or negative token counts")
    return t


def _members_and_starts(c: dict, table: SampleTable, shared: dict) -> tuple[list[int], list[int]]:
    """A column's members and row starts; columns of all samples at their token counts share one pair."""
    n = len(table)
    if c["members"] is None and c["rows"] is None and "all" in shared:
        return shared["all"]
    members = list(range(n)) if c["members"] is None else _ints(c["members"], "members")
    if any(not 0 <= i < n for i in members) or any(a >= b for a, b in zip(members, members[1:])):
        raise RecordFormatError(f"column {c['key']}: members {members[:8]}... not increasing indices below {n}")
    rows = [table.tokens[i] for i in members] if c["rows"] is None else _ints(c["rows"], "rows")
    if len(rows) != len(members) or any(r < 0 for r in rows):
        raise RecordFormatError(f"column {c['key']}: {len(rows)} row counts for {len(members)} members (each >= 0): "
                                f"rows {rows[:8]}")
    out = members, [0, *accumulate(rows)]
    if c["members"] is None and c["rows"] is None:
        shared["all"] = out
    return out


def _decode_column(c: dict, kind: str, table: SampleTable, payload: torch.Tensor, checks: list,
                   shared: dict, end: list[int]) -> Column:
    """``end``: [where the field before ends]; each field must sit where ``layout`` puts it, right after it."""
    _keys(c, _KEYS["column"], f"a {kind} column ({c.get('key') if isinstance(c, dict) else c!r})")
    members, starts = _members_and_starts(c, table, shared)
    meta = dict(_keys(c["meta"], _META_KEYS[kind], f"the meta of column {c['key']}"))
    if kind == "guidance" and meta["amax"] not in (None, "row", "sample"):  # (any other string was read as "row")
        raise RecordFormatError(f"column {c['key']}: amax {meta['amax']!r} is not None, 'row' or 'sample'")
    fields, spans = {}, []
    for name, dt, shape, off, crc in c["fields"]:
        if name in fields:
            raise RecordFormatError(f"column {c['key']}: field {name} given twice")
        dtype, shape = DTYPES.get(dt) if isinstance(dt, str) else None, tuple(_ints(shape, "shape"))
        if dtype is None:
            raise RecordFormatError(f"column {c['key']} field {name}: dtype {dt!r} is not one of {sorted(DTYPES)}")
        _check_dtype(kind, name, dtype, f"column {c['key']}", RecordFormatError)
        if any(n < 0 for n in shape):
            raise RecordFormatError(f"column {c['key']} field {name}: shape {shape} has a negative dimension")
        nbytes = math.prod(shape) * dtype.itemsize
        lead = len(members) if name == "amax" and meta.get("amax") == "sample" else starts[-1]
        if not shape or shape[0] != lead or off % ALIGN or off < 0 or off + nbytes > payload.numel():
            raise RecordFormatError(f"column {c['key']} field {name}: shape {shape} at {off} does not fit "
                                    f"{lead} rows in a payload of {payload.numel()} bytes")
        checks.append((f"{kind} checksum mismatch in column {c['key']} field {name}", off, nbytes, crc))
        spans.append((name, off, nbytes))
        fields[name] = payload[off : off + nbytes].view(dtype).view(shape)
    if not _REQUIRED[kind] <= fields.keys():
        raise RecordFormatError(f"column {c['key']}: fields {sorted(fields)} lack {sorted(_REQUIRED[kind])}")
    for name, off, n in spans:
        want = -(-end[0] // ALIGN) * ALIGN
        if off != want:  # (an offset moved onto another field's bytes read them as this field's)
            raise RecordFormatError(f"column {c['key']} field {name}: offset {off}, the layout puts it at {want} (the "
                                    f"first {ALIGN}-byte boundary after the field before it, which ends at {end[0]})")
        end[0] = off + n
    key = (int(c["key"][0]), str(c["key"][1])) if kind == "guidance" else int(c["key"])
    col = Column(key, members, starts, fields, meta)
    if kind == "guidance":
        _ints(meta["shape"], "shape")
        check_widths(f"column {c['key']}", meta, {n: tuple(fields[n].shape[1:]) for n in ("payload", "scales")})
        if (meta.get("amax") is None) != ("amax" not in fields):
            raise RecordFormatError(f"column {c['key']}: amax {meta.get('amax')!r} but fields {sorted(fields)}")
        if meta["mode"] not in ("compact", "full") or fields["valid"].dtype != torch.bool:
            raise RecordFormatError(f"column {c['key']}: mode {meta['mode']!r} / valid {fields['valid'].dtype}")
        try:
            PackedGuidance(table, [col]).site_record(0, 0) if members else None  # shape checks of SiteRecord
        except ValueError as e:
            raise RecordFormatError(f"column {c['key']}: {e}") from e
    return col


def _check_keys_once(kind: str, columns: list[Column]) -> None:
    """No sample has two columns of one key (the later one's rows replaced the earlier's)."""
    count: dict = {}
    for col in columns:
        count[col.key] = count.get(col.key, 0) + 1
    for key in (k for k, n in count.items() if n > 1):  # (several layouts of one site: disjoint samples)
        seen: set[int] = set()
        for col in (x for x in columns if x.key == key):
            twice = seen.intersection(col.members)
            if twice:
                raise RecordFormatError(f"{kind} column {key} holds sample index(es) {sorted(twice)[:8]} twice")
            seen.update(col.members)


def decode(head: dict, payload: torch.Tensor, *, verify: bool) -> tuple[PackedGuidance | None, PackedRouting | None]:
    """The chunk's columns as views of ``payload``; every size, offset (and checksum with ``verify``) checked
    first. Raises ``RecordFormatError`` (or KeyError / TypeError / ValueError on a malformed header)."""
    out, checks, tables, end = {}, [], {}, [0]
    _keys(head, _KEYS["head"], "the header")
    for kind, cls in (("guidance", PackedGuidance), ("routing", PackedRouting)):
        sec = head[kind]
        if sec is None:
            out[kind] = None
            continue
        _keys(sec, _KEYS["section"], f"the {kind} section")
        table = _decode_table(sec["table"]) if sec["table"] is not None else tables.get("guidance")
        if table is None:
            raise RecordFormatError(f"{kind} section without a sample table")
        tables[kind] = table
        shared: dict = {}
        cols = [_decode_column(c, kind, table, payload, checks, shared, end) for c in sec["columns"]]
        _check_keys_once(kind, cols)
        out[kind] = cls(table, cols)
    if end[0] != payload.numel():
        raise RecordFormatError(f"payload of {payload.numel()} bytes, its fields end at byte {end[0]}")
    if verify:  # every field before any sample is returned: all or nothing
        unchecked = [c[0] for c in checks if c[3] is None]
        if unchecked:
            first = unchecked[0].replace(" checksum mismatch", "")
            raise RecordFormatError(f"{len(unchecked)} field(s) without a checksum, e.g. {first}: the sender runs "
                                    "verify=False; give both sides the same verify")
        want = checks
        host = payload if payload.device.type == "cpu" else payload.cpu()
        for (what, _, _, crc), got in zip(want, checksums([host[o : o + n] for _, o, n, _ in want])):
            if got != crc:
                raise RecordFormatError(f"{what} (corrupt or partial transfer): got {got}, header says {crc}")
    return out["guidance"], out["routing"]
