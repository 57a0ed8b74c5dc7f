"""Trainer micro-batches straight from columns (``packed``): ``records.assemble`` and ``routing.assemble_routing``
without per-sample objects. Same acceptance rules (token hash, version, layout, row count), the same fallback
counts by reason and the same tensors as ``records.assemble`` given the keys of all the parts (``keys`` None here
means those, there the micro-batch's samples'); the work is a few index operations per (layer, site), not per
sample.

Row ``b`` of the micro-batch trains the sample with id ``sample_ids[b]`` (None: no sample, counted ``missing``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence

import torch

from ..formats import CompactGuidance, FullGuidance, get_format
from .layout import PackedLayout, as_layout
from .packed import Column, PackedGuidance, PackedRouting, _Packed, ranges
from .records import (
    FC2,
    _per_row,
    add_counts,
    check_counter,
    check_keys,
    check_topk,
    count_all_missing,
    missing_rows_per_token,
    reject_bad_scales,
    row_hashes,
    sample_id_list,
    token_mask,
)
from .routing import RoutingMismatchError
from .site import FallbackCounter, SiteGuidance, SiteKey

logger = logging.getLogger(__name__)


def _locate(parts: Sequence[_Packed], sample_ids: Sequence[int | None]) -> list[tuple[int, int] | None]:
    """(part, sample index) of each row's sample, None where absent."""
    where: dict[int, tuple[int, int]] = {}
    for p, part in enumerate(parts):
        for i, sid in enumerate(part.table.ids):
            if sid in where:
                raise ValueError(f"sample {sid} appears in two received chunks")
            where[sid] = (p, i)
    return [None if sid is None else where.get(sid) for sid in sample_id_list(sample_ids, rows=True)]


def _rows_by_column(parts: Sequence[_Packed], loc) -> list[tuple[Column, torch.Tensor, torch.Tensor]]:
    """(column, batch rows, member positions) of every column holding samples of this batch (int64 tensors;
    a sample on several rows appears once per row)."""
    out = []
    for p, part in enumerate(parts):
        pairs = [(b, at[1]) for b, at in enumerate(loc) if at is not None and at[0] == p]
        if not pairs:
            continue
        rows, idx = torch.tensor(pairs, dtype=torch.int64).unbind(1)  # [n] batch rows, [n] sample indices
        seen: dict[int, tuple] = {}  # columns sharing one members list share their (rows, positions) tensors
        for c in part.columns:
            if id(c.members) not in seen:
                pos = torch.full((len(part.table),), -1, dtype=torch.int64)
                pos[torch.as_tensor(c.members, dtype=torch.int64)] = torch.arange(len(c.members))
                js = pos[idx]
                keep = js >= 0
                seen[id(c.members)] = (c.members, rows, js) if bool(keep.all()) else (c.members, rows[keep], js[keep])
            _, bs, js = seen[id(c.members)]
            if bs.numel():
                out.append((c, bs, js))
    return out


class _Scatter:
    """Token positions of a [B, S] mask: writes member rows of a column into batch rows (``shape`` [B, S]), or with
    a ``PackedLayout`` into the packed row (``shape`` [1, T])."""

    def __init__(self, mask: torch.Tensor, layout: PackedLayout | None = None):
        if layout is None:
            self.shape = tuple(mask.shape)
            self.flat = mask.reshape(-1).nonzero().squeeze(1)  # [T] positions b * S + s, row-major
        else:
            self.flat = as_layout(layout).positions(mask)[1]  # [T] packed positions, row-major
            self.shape = (1, layout.total)
        self.counts = mask.sum(1).cpu()  # [B]
        self.tokens = self.counts.tolist()
        self.first = (torch.cumsum(self.counts, 0) - self.counts).to(self.flat.device)  # [B] first token of each row
        self._cache: dict[tuple, tuple] = {}  # columns of one chunk share starts and (rows, positions) tensors

    def index(self, c: Column, bs: torch.Tensor, js: torch.Tensor, device) -> tuple[torch.Tensor, ...]:
        """(destination positions in [B * S], source rows of ``c``, tokens per row): rows ``bs`` <- members ``js``."""
        key = (id(c.starts), id(bs), id(js), str(device))
        hit = self._cache.get(key)
        if hit is None:
            dev = self.flat.device
            lens = self.counts[bs].to(dev)
            dst = self.flat[ranges(self.first[bs.to(dev)], lens)]
            hit = self._cache[key] = (dst, c.row_index(js, device), lens, c.starts, bs, js)  # (keeps the ids alive)
        return hit[:3]

    def put(self, out: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
        out.view(self.shape[0] * self.shape[1], *out.shape[2:]).index_copy_(0, dst, rows.to(out.device))


def _member_rows(c: Column, js: torch.Tensor) -> torch.Tensor:
    """Rows each member ``js`` of ``c`` holds (int64, host)."""
    starts = torch.as_tensor(c.starts, dtype=torch.int64)
    return starts[js + 1] - starts[js]


def _layout(c: Column) -> tuple:
    """What ``records.SiteRecord.layout`` compares (and whether there is an amax)."""
    f = c.fields
    return (c.meta["mode"], c.meta["fmt"], tuple(c.meta["shape"]), tuple(f["valid"].shape[1:]),
            "expert_ids" in f, c.meta.get("amax") is not None)


def _status(parts, loc, token_ids, mask, versions) -> list[str]:
    hashes, out = row_hashes(token_ids, mask)[0], []
    for b, at in enumerate(loc):
        t = None if at is None else parts[at[0]].table
        if t is None:
            out.append("missing")
        elif t.hashes[at[1]] != hashes[b]:
            out.append("token_hash")
        elif t.versions[at[1]] != versions[b]:
            out.append("version")
        else:
            out.append("ok")
    return out


def assemble_packed(
    parts: Sequence[PackedGuidance],
    sample_ids: Sequence[int | None],
    token_ids: torch.Tensor,
    *,
    versions: int | Sequence[int],
    counter: FallbackCounter,
    attention_mask: torch.Tensor | None = None,
    lengths=None,
    keys: Sequence[SiteKey] | None = None,
    topk: int | None = None,
    layout: PackedLayout | None = None,
) -> dict[SiteKey, SiteGuidance]:
    """``records.assemble`` from columns: batch-major guidance (with ``layout``: the packed row's [1, T, ...]),
    mismatching rows zero/invalid and counted (a key no sample has: ``topk`` rows per token at FC2, see
    ``records.missing_rows_per_token``). ``keys`` None: every key of ``parts`` (the step's or the received shard's,
    ``part_keys``), so that a row without a sample or record is counted at each of them whatever else its
    micro-batch holds (``parts`` without any column: once per token).
    """
    check_counter(counter)
    keys = check_keys(keys)
    mask = token_mask(token_ids, attention_mask=attention_mask, lengths=lengths)  # [B, S]
    B = mask.shape[0]
    if len(sample_ids) != B:
        raise ValueError(f"{len(sample_ids)} sample ids for a batch of {B} rows")
    scatter = _Scatter(mask, layout)  # (a layout that does not fit refuses before anything is counted)
    loc = _locate(parts, sample_ids)
    status = _status(parts, loc, token_ids, mask, _per_row(versions, B, "versions"))
    by_key: dict = {}
    for c, bs, js in _rows_by_column(parts, loc):
        by_key.setdefault(c.key, []).append((c, bs, js))
    out, rows = {}, FallbackCounter()  # (rows: added to counter at the end, add_counts)
    if keys is None:  # every key of ``parts``, not only this micro-batch's: its rows count alike in any micro-batch
        keys = part_keys(parts)
        if not keys:
            count_all_missing(scatter.tokens, rows)
    check_topk(topk)
    if topk is None:
        topk = next((c.fields["valid"].shape[-1] for p in parts for c in p.columns if c.key[1] == FC2), None)
    for key in keys:
        sg = _assemble_key(key, by_key.get(key, []), status, mask, scatter, rows, topk)
        if sg is not None:
            out[key] = sg
    bad = Counter(s for s in status if s != "ok")
    if bad:
        logger.info("guidance rejected for %d of %d samples: %s", sum(bad.values()), B, dict(bad))
    add_counts(counter, rows)
    return out


def part_keys(parts: Sequence[PackedGuidance]) -> list[SiteKey]:
    """The (layer, site) keys of every column of ``parts``, sorted."""
    return sorted({c.key for p in parts for c in p.columns})


_REASONS = ("missing", "token_hash", "version", "shape")  # row states 0..3; 4: used


def _assemble_key(key, groups, status, mask, scatter: _Scatter, counter: FallbackCounter,
                  topk: int | None = None) -> SiteGuidance | None:
    if not groups:
        tokens = sum(scatter.tokens)
        counter.add(0, {"missing": tokens * missing_rows_per_token(key, topk, tokens)})
        return None
    layouts: Counter = Counter()
    for c, bs, _ in sorted(groups, key=lambda g: int(g[1].min())):  # ties: the layout of the earliest row wins
        layouts[_layout(c)] += bs.numel()
    layout = layouts.most_common(1)[0][0]
    t = next(c for c, _, _ in groups if _layout(c) == layout)
    state = torch.tensor([_REASONS.index(s) if s != "ok" else 0 for s in status], dtype=torch.int64)  # [B]
    ok_row = torch.tensor([s == "ok" for s in status], dtype=torch.bool)
    todo = []
    for c, bs, js in groups:
        ok = ok_row[bs]
        fits = ok & (_member_rows(c, js) == scatter.counts[bs]) if _layout(c) == layout else torch.zeros_like(ok)
        state[bs[ok]] = torch.where(fits[ok], 4, 3)
        if bool(fits.all()):
            todo.append((c, bs, js))  # the shared tensors: their scatter index is computed once
        elif bool(fits.any()):
            todo.append((c, bs[fits], js[fits]))
    per_token = math.prod(t.fields["valid"].shape[1:])
    counter.add(0, {r: int(scatter.counts[state == k].sum()) * per_token for k, r in enumerate(_REASONS)})
    buf = _zeros(t, scatter.shape, mask.device)
    for c, bs, js in todo:
        _fill(buf, c, bs, js, scatter, counter)
    fmt = get_format(t.meta["fmt"])
    common = dict(block_scales=buf["scales"].view(fmt.scale_dtype), global_amax=buf.get("amax"),
                  shape=(*scatter.shape, *t.meta["shape"]), fmt=t.meta["fmt"])
    rec = (CompactGuidance(mantissa_bits=buf["payload"], **common) if t.meta["mode"] == "compact"
           else FullGuidance(codes=buf["payload"], **common))
    return reject_bad_scales(key, SiteGuidance(rec, buf["valid"], buf.get("expert_ids")), counter)


def _zeros(t: Column, lead: tuple[int, int], device) -> dict[str, torch.Tensor]:
    """Zero [*lead, ...] tensors ([B, S] or [1, T]) per field of template column ``t`` (amax per row: [*lead, ...,
    1] float32)."""
    out = {n: torch.zeros((*lead, *f.shape[1:]), dtype=f.dtype, device=device)
           for n, f in t.fields.items() if n != "amax"}
    if "amax" in t.fields:
        out["amax"] = torch.zeros((*lead, *t.fields["scales"].shape[1:-1], 1), dtype=torch.float32, device=device)
    return out


def _fill(buf: dict, c: Column, bs: torch.Tensor, js: torch.Tensor, scatter: _Scatter,
          counter: FallbackCounter) -> None:
    dev = c.fields["valid"].device
    dst, src, lens = scatter.index(c, bs, js, dev)
    for name, f in c.fields.items():
        if name == "amax" and c.meta.get("amax") == "sample":  # one per-tensor amax per member -> every row
            per = f.index_select(0, js.to(dev))
            rows = per.to(lens.device).repeat_interleave(lens)
            rows = rows.view(-1, *[1] * (buf["amax"].dim() - 2)).expand(-1, *buf["amax"].shape[2:])
        else:
            rows = f.index_select(0, src)
        scatter.put(buf[name], dst, rows)
        if name == "valid":
            used = int(rows.sum())
            counter.add(used, {"not_recorded": rows.numel() - used})


def assemble_routing_packed(parts: Sequence[PackedRouting], sample_ids: Sequence[int | None],
                            token_ids: torch.Tensor, *, versions: int | Sequence[int],
                            attention_mask: torch.Tensor | None = None, lengths=None,
                            layout: PackedLayout | None = None) -> dict[int, torch.Tensor]:
    """``routing.assemble_routing`` from columns: ``{layer: int64 [B, S, topk]}`` (with ``layout``: [1, T, topk]);
    any mismatch raises."""
    mask = token_mask(token_ids, attention_mask=attention_mask, lengths=lengths)
    B = mask.shape[0]
    if len(sample_ids) != B:
        raise ValueError(f"{len(sample_ids)} routing sample ids for a batch of {B} rows")
    scatter = _Scatter(mask, layout)
    loc = _locate(parts, sample_ids)
    vers = _per_row(versions, B, "versions")
    status = _status(parts, loc, token_ids, mask, vers)
    groups = _rows_by_column(parts, loc)
    layers = sorted({c.key for c, _, _ in groups})
    present = torch.zeros(len(layers), B, dtype=torch.bool)  # [layers, B]: which rows have each layer
    for c, bs, _ in groups:
        present[layers.index(c.key), bs] = True
    odd = (present != present[:, :1]).any(0)  # rows whose layer set differs from row 0's
    for b, st in enumerate(status):
        problem = None
        if st != "ok":
            sid = sample_ids[b]
            have = parts[loc[b][0]].table.versions[loc[b][1]] if loc[b] else None
            problem = {"missing": "missing",
                       "token_hash": f"sample {sid} was recorded for other tokens (token_hash)",
                       "version": f"sample {sid} has version {have}, the trainer expects {vers[b]}"}[st]
        elif bool(odd[b]):
            mine = [x for x, h in zip(layers, present[:, b].tolist()) if h]
            first = [x for x, h in zip(layers, present[:, 0].tolist()) if h]
            problem = f"layers {mine} != {first} of the other samples"
        if problem is not None:
            raise RoutingMismatchError(f"routing for batch row {b}: {problem}; routing replay needs every sample")
    out = {}
    for c, bs, js in groups:
        experts = c.fields["experts"]
        bad = (_member_rows(c, js) != scatter.counts[bs]).nonzero()
        if bad.numel():
            b = int(bs[bad[0, 0]])
            raise RoutingMismatchError(f"routing for batch row {b}: layer {c.key} has "
                                       f"{int(_member_rows(c, js)[bad[0, 0]])} rows for {scatter.tokens[b]} tokens")
        t = out.setdefault(c.key, torch.zeros(*scatter.shape, experts.shape[-1], dtype=torch.int64,
                                              device=mask.device))
        if t.shape[-1] != experts.shape[-1]:
            raise RoutingMismatchError(f"routing layer {c.key}: top-k {experts.shape[-1]} != {t.shape[-1]}")
        dst, src, _ = scatter.index(c, bs, js, experts.device)
        scatter.put(t, dst, experts.index_select(0, src).to(torch.int64))
    return dict(sorted(out.items()))
