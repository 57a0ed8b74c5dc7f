"""Columnar guidance: the records of many samples stored per (layer, site) as one tensor of rows per field.

A rollout step has hundreds of short samples x tens of guided sites; one tensor per sample and site makes
every consumer (sync, assembly) do tens of thousands of small tensor operations. Here the rows of all
samples are stored back to back per ``Column`` (member j owns rows ``starts[j]:starts[j+1]``), with a
``SampleTable`` (id, version, token hash, token count per sample). ``split_batch`` builds one with a
single gather per field and hands out per-sample ``SampleGuidance`` *views* into it (``source`` points
back here, so ``GuidanceSync`` can ship whole columns); a received chunk is decoded into the same form and
``assemble_packed`` fills a trainer micro-batch from it with a few index operations per site.

Column fields: guidance ``payload`` (uint8 packed codes or mantissa bits), ``scales`` (uint8 bit patterns),
``amax`` (float32, per row ``[R, ..., 1]``, or one 0-dim per-tensor amax per member: ``[M]``), ``valid``
(bool), ``expert_ids`` (int64, FC2); routing ``experts`` (uint8/int16/int32 ``[R, topk]``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

import torch

from ..formats import CompactGuidance, FullGuidance, get_format
from .records import SampleGuidance, SiteRecord, payload_of
from .routing import SampleRouting

GUIDANCE_FIELDS = ("payload", "scales", "amax", "valid", "expert_ids")


@dataclass(frozen=True)
class SampleTable:
    """Per sample (index i): id, policy version, token hash and number of tokens."""

    ids: list[int]
    versions: list[int]
    hashes: list[str]
    tokens: list[int]

    def __post_init__(self):
        n = len(self.ids)
        if not (len(self.versions) == len(self.hashes) == len(self.tokens) == n):
            raise ValueError(f"sample table columns differ in length: ids {n}, versions {len(self.versions)}, "
                             f"hashes {len(self.hashes)}, tokens {len(self.tokens)}")

    def __len__(self) -> int:
        return len(self.ids)

    def as_dict(self) -> dict:
        return {"ids": self.ids, "versions": self.versions, "hashes": self.hashes, "tokens": self.tokens}


@dataclass(frozen=True)
class Column:
    """One (layer, site) (guidance) or one layer (routing): rows of ``members`` back to back per field."""

    key: tuple | int
    members: list[int]  # sample indices, increasing
    starts: list[int]  # len(members) + 1: member j owns rows starts[j]:starts[j+1]
    fields: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)  # guidance: mode, fmt, shape (row tail), amax ("row"|"sample"|None)

    def row_index(self, js: Sequence[int] | torch.Tensor, device=None) -> torch.Tensor:
        """int64 row indices of members ``js`` (positions in ``members``), their rows in order."""
        starts = torch.as_tensor(self.starts, dtype=torch.int64, device=device)
        js = torch.as_tensor(js, dtype=torch.int64, device=device)
        return ranges(starts[js], starts[js + 1] - starts[js])


def ranges(first: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(first[i], first[i] + lengths[i])`` (int64, vectorised)."""
    total = int(lengths.sum()) if lengths.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=first.device)
    before = torch.cumsum(lengths, 0) - lengths  # exclusive prefix sums
    return torch.repeat_interleave(first - before, lengths, output_size=total) + torch.arange(
        total, device=first.device)


@dataclass
class _Packed:
    table: SampleTable
    columns: list[Column]
    _views: list[tuple] | None = field(default=None, repr=False)  # per sample (keys, values) of ``to_samples``

    @cached_property
    def membership(self) -> list[dict[int, int]]:
        """Per column: sample index -> position in ``members``."""
        return [{i: j for j, i in enumerate(c.members)} for c in self.columns]

    @cached_property
    def sample_nbytes(self) -> list[int]:
        """Bytes each sample holds (``SampleGuidance.nbytes`` / ``SampleRouting.nbytes``), from the column shapes."""
        out = [0] * len(self.table)
        for c in self.columns:
            per_sample = c.meta.get("amax") == "sample"
            per_row = sum(t[:1].nbytes for k, t in c.fields.items() if not (k == "amax" and per_sample))
            amax = c.fields["amax"].element_size() if per_sample else 0
            for j, i in enumerate(c.members):
                out[i] += per_row * (c.starts[j + 1] - c.starts[j]) + amax
        return out


class PackedGuidance(_Packed):
    """Guidance of many samples in columns keyed by (layer, site) (see the module docstring)."""

    def site_record(self, col: int, j: int) -> SiteRecord:
        """Member ``j`` of column ``col`` as a ``SiteRecord`` of views."""
        c = self.columns[col]
        a, b = c.starts[j], c.starts[j + 1]
        f, m = c.fields, c.meta
        amax = f.get("amax")
        if amax is not None:
            amax = amax[j] if m["amax"] == "sample" else amax[a:b]
        fmt = get_format(m["fmt"])
        common = dict(block_scales=f["scales"][a:b].view(fmt.scale_dtype), global_amax=amax,
                      shape=(b - a, *m["shape"]), fmt=m["fmt"])
        rec = (CompactGuidance(mantissa_bits=f["payload"][a:b], **common) if m["mode"] == "compact"
               else FullGuidance(codes=f["payload"][a:b], **common))
        ids = f.get("expert_ids")
        return SiteRecord(rec, f["valid"][a:b], None if ids is None else ids[a:b])

    def guidance_nbytes(self) -> int:
        """The samples' ``SampleGuidance.guidance_nbytes`` summed (payload + scales + amax of every column)."""
        return sum(c.fields[k].nbytes for c in self.columns for k in ("payload", "scales", "amax") if k in c.fields)

    def to_samples(self) -> list[SampleGuidance]:
        """One ``SampleGuidance`` per sample, its tensors views into the columns (``source`` set)."""
        sites: list[dict] = [{} for _ in range(len(self.table))]
        for ci, c in enumerate(self.columns):
            for j, i in enumerate(c.members):
                sites[i][c.key] = self.site_record(ci, j)
        self._views = [(tuple(d), tuple(d.values())) for d in sites]  # what source_of checks a sample against
        t = self.table
        return [SampleGuidance(t.ids[i], t.versions[i], t.hashes[i], t.tokens[i], s, source=(self, i))
                for i, s in enumerate(sites)]


class PackedRouting(_Packed):
    """Routing of many samples in columns keyed by layer, field ``experts`` [R, topk]."""

    def to_samples(self) -> list[SampleRouting]:
        """One ``SampleRouting`` per sample, its tensors views into the columns (``source`` set)."""
        experts: list[dict] = [{} for _ in range(len(self.table))]
        for c in self.columns:
            t = c.fields["experts"]
            for j, i in enumerate(c.members):
                experts[i][c.key] = t[c.starts[j] : c.starts[j + 1]]
        self._views = [(tuple(d), tuple(d.values())) for d in experts]
        t = self.table
        return [SampleRouting(t.ids[i], t.versions[i], t.hashes[i], t.tokens[i], e, source=(self, i))
                for i, e in enumerate(experts)]


def column_meta(rec: SiteRecord) -> dict:
    r = rec.record
    amax = None if r.global_amax is None else "sample" if r.global_amax.dim() == 0 else "row"
    return {"mode": "compact" if rec.compact else "full", "fmt": r.fmt, "shape": list(r.shape[1:]), "amax": amax}


def site_fields(rec: SiteRecord) -> dict[str, torch.Tensor]:
    """The column fields of one sample's record (``amax`` 0-dim per tensor becomes ``[1]``)."""
    r = rec.record
    out = {"payload": payload_of(r), "scales": r.block_scales.view(torch.uint8), "valid": rec.valid}
    if r.global_amax is not None:
        out["amax"] = r.global_amax.to(torch.float32).reshape(-1 if r.global_amax.dim() == 0 else r.global_amax.shape)
    if rec.expert_ids is not None:
        out["expert_ids"] = rec.expert_ids.to(torch.int64)
    return out


def source_of(samples: Sequence[SampleGuidance] | Sequence[SampleRouting]) -> tuple[_Packed, list[int]] | None:
    """(columns, sample indices) when every sample is an unmodified view of the same packed batch."""
    if not samples or samples[0].source is None:
        return None
    packed = samples[0].source[0]
    views = packed._views
    idx = []
    for s in samples:
        if views is None or s.source is None or s.source[0] is not packed:
            return None
        i = s.source[1]
        keys, values = views[i]
        have = s.sites if isinstance(s, SampleGuidance) else s.experts
        if tuple(have) != keys or not all(map(operator.is_, have.values(), values)):
            return None  # sites replaced or edited since the split: ship the sample's own tensors
        t = packed.table
        if (s.sample_id, s.version, s.token_hash, s.num_tokens) != (t.ids[i], t.versions[i], t.hashes[i], t.tokens[i]):
            return None  # re-stamped since the split (dataclasses.replace): the columns' table no longer says it
        idx.append(i)
    return packed, idx


def _gather_rows(mask: torch.Tensor):
    """A function taking ``t`` [B, S, ...] to its token rows [T, ...] (row-major, padding dropped)."""
    B, S = mask.shape
    flat: dict[torch.device, torch.Tensor] = {}

    def rows(t: torch.Tensor) -> torch.Tensor:
        if t.device not in flat:
            flat[t.device] = mask.reshape(-1).nonzero().squeeze(1).to(t.device)  # [T] positions b * S + s
        return t.reshape(B * S, *t.shape[2:]).index_select(0, flat[t.device])

    return rows


def pack_batch(batch, token_ids: torch.Tensor, mask: torch.Tensor, versions: list[int], ids: list[int]
               ) -> PackedGuidance:
    """Batch-major guidance ``{key: SiteGuidance [B, S, ...]}`` -> columns of the B samples' token rows."""
    from .records import row_hashes

    hashes, counts = row_hashes(token_ids, mask)
    starts, members, rows = [0, *accumulate(counts)], list(range(len(counts))), _gather_rows(mask)
    cols = []
    for key, sg in sorted(batch.items(), key=lambda kv: kv[0]):  # (layer, site): the same bytes whatever the
        r = sg.record                                              # order the recorder met the sites in
        fields = {"payload": rows(payload_of(r)), "scales": rows(r.block_scales.view(torch.uint8)),
                  "valid": rows(sg.valid)}
        kind = None
        if r.global_amax is not None:
            kind = "sample" if r.global_amax.dim() == 0 else "row"
            amax = r.global_amax.to(torch.float32)
            fields["amax"] = amax.reshape(1).expand(len(counts)).clone() if kind == "sample" else rows(amax)
        if sg.expert_ids is not None:
            fields["expert_ids"] = rows(sg.expert_ids.to(torch.int64))
        meta = {"mode": "compact" if sg.compact else "full", "fmt": r.fmt, "shape": list(r.shape[2:]), "amax": kind}
        cols.append(Column(key, members, starts, fields, meta))
    return PackedGuidance(SampleTable(ids, versions, hashes, counts), cols)


def pack_routing(routing, token_ids: torch.Tensor, mask: torch.Tensor, versions: list[int], ids: list[int],
                 dtype: torch.dtype) -> PackedRouting:
    """``{layer: [B, S, topk]}`` -> columns of the B samples' token rows as ``dtype``."""
    from .records import row_hashes

    hashes, counts = row_hashes(token_ids, mask)
    starts, members, rows = [0, *accumulate(counts)], list(range(len(counts))), _gather_rows(mask)
    cols = [Column(layer, members, starts, {"experts": rows(r).to(dtype)}) for layer, r in sorted(routing.items())]
    return PackedRouting(SampleTable(ids, versions, hashes, counts), cols)
