"""Per-sample guidance records: cut from a rollout batch, checked and re-assembled for a trainer batch.

Layout choice: a sample's ``SiteRecord`` keeps only the sample's *tokens* (positions where the
rollout's attention mask is set, in order; padding dropped), so records are independent of the
padding side and batch shape of either engine. Rows are token positions (FC1, KV) or
(token position, k-th selected expert) (FC2, with the rollout's ``expert_ids``). The rollout's
own ``valid`` mask is kept per row (e.g. rows it could not record).

Every sample carries the policy ``version`` that generated it and a ``token_hash`` of its token
ids. ``assemble`` accepts a record only for the sample it was computed on (same hash) and the
version the trainer recorded for that sample; async RL trains on older samples with their own
(older) guidance, see ``staleness_stats``. Anything else is rejected and counted by reason:
``missing`` (no record), ``token_hash``, ``version``, ``shape`` (row layout or format differs
from the batch), ``not_recorded`` (the rollout marked the row invalid).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..config import ACTIVATION_SITES
from ..formats import CompactGuidance, FullGuidance
from ..formats.tensor import scales_usable
from .layout import PackedLayout, as_layout
from .site import FallbackCounter, SiteGuidance, SiteKey, check_rows, is_integer

logger = logging.getLogger(__name__)

FC2 = "expert_fc2_in"

Record = FullGuidance | CompactGuidance


def payload_of(record: Record) -> torch.Tensor:
    """Packed codes (full) or packed mantissa bits (compact)."""
    return record.mantissa_bits if isinstance(record, CompactGuidance) else record.codes


def with_tensors(record: Record, payload, block_scales, global_amax, shape) -> Record:
    """A record of the same kind and format with new tensors and shape."""
    field = "mantissa_bits" if isinstance(record, CompactGuidance) else "codes"
    kw = {field: payload}
    return type(record)(block_scales=block_scales, global_amax=global_amax, shape=tuple(shape), fmt=record.fmt, **kw)


@dataclass(frozen=True)
class SiteRecord:
    """Guidance of one sample at one (layer, site): ``record.shape`` [L, ...], L = sample tokens."""

    record: Record
    valid: torch.Tensor  # bool [L] (FC1, KV) or [L, topk] (FC2)
    expert_ids: torch.Tensor | None = None  # int64 [L, topk] (FC2)

    def __post_init__(self):
        check_rows(self.record, self.valid, self.expert_ids, 1)

    @property
    def num_tokens(self) -> int:
        return int(self.record.shape[0])

    @property
    def compact(self) -> bool:
        return isinstance(self.record, CompactGuidance)

    def guidance_nbytes(self) -> int:
        """Bytes of the guidance proper (payload + scales + amax): what ``accounting`` predicts."""
        r = self.record
        amax = 0 if r.global_amax is None else r.global_amax.nbytes
        return payload_of(r).nbytes + r.block_scales.nbytes + amax

    def nbytes(self) -> int:
        """All bytes held, side data (valid, expert_ids) included."""
        ids = 0 if self.expert_ids is None else self.expert_ids.nbytes
        return self.guidance_nbytes() + self.valid.nbytes + ids

    def to(self, device, non_blocking: bool = False) -> SiteRecord:
        """A copy on ``device`` (same bits)."""
        r = self.record

        def mv(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        rec = with_tensors(r, mv(payload_of(r)), mv(r.block_scales), mv(r.global_amax), r.shape)
        return SiteRecord(rec, mv(self.valid), mv(self.expert_ids))

    def layout(self) -> tuple:
        """What must agree between samples assembled into one batch (everything but L)."""
        r = self.record
        return (type(r).__name__, r.fmt, tuple(r.shape[1:]), tuple(self.valid.shape[1:]), self.expert_ids is not None,
                r.global_amax is not None)


@dataclass(frozen=True)
class SampleGuidance:
    """All guidance of one sequence (prompt + response) of a rollout batch."""

    sample_id: int
    version: int
    token_hash: str
    num_tokens: int
    sites: dict[SiteKey, SiteRecord]
    source: tuple | None = field(default=None, compare=False, repr=False)
    """(``packed.PackedGuidance``, index) when the records are views of one (``split_batch``, a received chunk)."""

    def guidance_nbytes(self) -> int:
        return sum(r.guidance_nbytes() for r in self.sites.values())

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.sites.values())

    def to(self, device, non_blocking: bool = False) -> SampleGuidance:
        """A copy with every record on ``device``."""
        sites = {k: r.to(device, non_blocking) for k, r in self.sites.items()}
        return SampleGuidance(self.sample_id, self.version, self.token_hash, self.num_tokens, sites)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (copied to host if needed)."""
    t = t.detach().contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.nbytes) if t.nbytes else b""


def token_hash(token_ids: torch.Tensor) -> str:
    """blake2b-128 (hex) over the int64 little-endian bytes of a 1-D token id sequence."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.is_floating_point() \
            or token_ids.is_complex() or token_ids.dtype == torch.bool:  # (1.7 hashed as token 1; [B, S] as one row)
        got = f"{token_ids.dtype} {tuple(token_ids.shape)}" if isinstance(token_ids, torch.Tensor) else \
            type(token_ids).__name__
        raise ValueError(f"token_hash needs a 1-D integer tensor of token ids, got {got}")
    return hashlib.blake2b(tensor_bytes(token_ids.to(torch.int64)), digest_size=16).hexdigest()


def token_mask(token_ids: torch.Tensor, *, attention_mask=None, lengths=None) -> torch.Tensor:
    """bool [B, S]: which positions hold tokens. Give ``attention_mask`` [B, S] or ``lengths`` [B]
    (right padding); neither means every position is a token."""
    if token_ids.dim() != 2:
        raise ValueError(f"token_ids must be [B, S], got shape {tuple(token_ids.shape)}")
    if attention_mask is not None and lengths is not None:
        raise ValueError("give attention_mask or lengths, not both")
    B, S = token_ids.shape
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != token_ids shape {(B, S)}")
        return attention_mask.to(device=token_ids.device).bool()
    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=token_ids.device).long()
        if tuple(lengths.shape) != (B,) or bool((lengths < 0).any()) or bool((lengths > S).any()):
            raise ValueError(f"lengths must be [B={B}] with values in 0..{S}, got {lengths.tolist()}")
        return torch.arange(S, device=token_ids.device)[None, :] < lengths[:, None]
    return torch.ones(B, S, dtype=torch.bool, device=token_ids.device)


def _per_row(value, B: int, what: str) -> list[int]:
    """One int per batch row from an integer (Python, NumPy or a 0-d tensor: every row's) or B of them; a float
    (3.5, or 3.0) is refused, not truncated."""
    if is_integer(value):
        return [int(value)] * B
    vals = _ints(value, lambda: f"{what}={value!r}: give an int or {B} ints")
    if len(vals) != B:
        raise ValueError(f"{what} has {len(vals)} entries for a batch of {B}")
    return vals


def _ints(values, message) -> list[int]:
    """``values`` as a list of ints; ``ValueError(message())`` when it is not iterable or holds a non-integer."""
    try:
        vals = list(values)
    except TypeError as e:
        raise ValueError(message()) from e
    if not all(map(is_integer, vals)):
        raise ValueError(message())
    return [int(v) for v in vals]


def sample_id_list(sample_ids, *, rows: bool = False) -> list[int | None]:
    """``sample_ids`` (ids to look up) as Python ints: each a Python or NumPy int or a 0-d integer tensor (an integer
    tensor gives its elements); with ``rows`` (a trainer batch's row b trains ``sample_ids[b]``) None is a row without
    a sample. Anything else is refused, naming it: looked up as given, a 0-d tensor (hashed by identity), a string or
    3.5 matched no sample of a spilled step (every row counted ``missing``), while a step held as columns took
    ``int()`` of it (3.5: sample 3)."""
    try:
        vals = list(sample_ids)
    except TypeError as e:
        raise ValueError(f"sample_ids={sample_ids!r} is not a sequence of int sample ids") from e
    for i, v in enumerate(vals):
        if not (is_integer(v) or (rows and v is None)):
            raise ValueError(f"sample_ids[{i}]={v!r} is not an int sample id"
                             + (" or None (a row without a sample)" if rows else ""))
    return [None if v is None else int(v) for v in vals]


def split_batch(
    batch: Mapping[SiteKey, SiteGuidance],
    token_ids: torch.Tensor,
    *,
    version: int | Sequence[int],
    attention_mask: torch.Tensor | None = None,
    lengths=None,
    sample_ids: Sequence[int] | None = None,
) -> list[SampleGuidance]:
    """Cut batch-major rollout guidance into one ``SampleGuidance`` per sequence (batch row).

    The rows of all samples are gathered once per field into a ``packed.PackedGuidance`` (token rows only,
    copies: the batch can be freed); each sample's tensors are views into it (``source``), which lets
    ``GuidanceSync`` ship whole columns instead of per-sample tensors.
    """
    return pack_guidance(batch, token_ids, version=version, attention_mask=attention_mask, lengths=lengths,
                         sample_ids=sample_ids).to_samples()


def pack_guidance(
    batch: Mapping[SiteKey, SiteGuidance],
    token_ids: torch.Tensor,
    *,
    version: int | Sequence[int],
    attention_mask: torch.Tensor | None = None,
    lengths=None,
    sample_ids: Sequence[int] | None = None,
):
    """``split_batch`` without the per-sample views: the batch's token rows as a ``packed.PackedGuidance``
    (sample ``i`` of its table is batch row ``i``). ``GuidanceCache.put`` keeps it as it is."""
    from .packed import pack_batch

    mask = token_mask(token_ids, attention_mask=attention_mask, lengths=lengths)  # [B, S]
    B, S = mask.shape
    for key, sg in batch.items():
        if tuple(sg.record.shape[:2]) != (B, S):
            raise ValueError(f"guidance {key} has rows {tuple(sg.record.shape[:2])}, token_ids {(B, S)}")
    versions = _per_row(version, B, "version")
    ids = list(range(B)) if sample_ids is None else \
        _ints(sample_ids, lambda: f"sample_ids={sample_ids!r}: give {B} distinct int ids")  # (3.5: not sample 3)
    if len(ids) != B or len(set(ids)) != B:
        raise ValueError(f"sample_ids must be {B} distinct ids, got {ids}")
    return pack_batch(batch, token_ids, mask, versions, ids)


def row_hashes(token_ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[str], list[int]]:
    """(``token_hash`` of each row's tokens, tokens per row) with one host copy of the batch's tokens."""
    counts = mask.sum(1).tolist()
    raw = tensor_bytes(token_ids[mask.to(token_ids.device)].to(torch.int64))  # row-major: rows in order
    out, off = [], 0
    for n in counts:
        out.append(hashlib.blake2b(raw[8 * off : 8 * (off + n)], digest_size=16).hexdigest())
        off += n
    return out, counts


def _row_status(samples, token_ids, mask, versions) -> list[str]:
    status, hashes = [], row_hashes(token_ids, mask)[0]
    for b, s in enumerate(samples):
        if s is None:
            status.append("missing")
        elif s.token_hash != hashes[b]:
            status.append("token_hash")
        elif s.version != versions[b]:
            status.append("version")
        else:
            status.append("ok")
    return status


def assemble(
    samples: Sequence[SampleGuidance | None],
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
    """Batch-major guidance for a trainer micro-batch: ``samples[b]`` belongs to row ``b``; with ``layout`` (a
    ``guidance.layout.PackedLayout``), the packed row's [1, T, ...] instead, each sample's tokens at its segment.

    ``versions[b]`` is the policy version that generated the sample of row ``b`` (as the trainer
    recorded it). Records that don't match are zero rows with ``valid=False``, counted in
    ``counter`` by reason. A key no sample has is left out (the trainer falls back there) and its rows
    are counted ``missing``: one per token, ``topk`` per token at ``expert_fc2_in`` (the trainer's router
    top-k; None: the top-k of the batch's FC2 records, see ``missing_rows_per_token``). ``keys`` None: the keys
    of ``samples``; a micro-batch none of whose samples has a record then counts each token once (the sites are
    unknown, ``count_all_missing``), fewer rows than it counts beside a sample with records: give the step's keys
    (``GuidanceCache.assemble`` does) for counts that add up alike over any split of a step into micro-batches.
    Each key given is a distinct (layer, site) pair (``check_keys``), refused otherwise before anything is counted.
    """
    check_counter(counter)
    keys = check_keys(keys)
    mask = token_mask(token_ids, attention_mask=attention_mask, lengths=lengths)  # [B, S]
    B = mask.shape[0]
    if len(samples) != B:
        raise ValueError(f"{len(samples)} samples for a batch of {B} rows")
    dest = destinations(mask, layout)  # (a layout that does not fit refuses before anything is counted)
    status = _row_status(samples, token_ids, mask, _per_row(versions, B, "versions"))
    tokens = mask.sum(1).tolist()
    rows = FallbackCounter()  # this call's counts, added to ``counter`` once nothing can raise (``add_counts``)
    if keys is None:
        keys = sorted({k for s in samples if s is not None for k in s.sites})
        if not keys:
            count_all_missing(tokens, rows)
    check_topk(topk)
    if topk is None:
        topk = next((r.valid.shape[-1] for s in samples if s is not None for (_, site), r in s.sites.items()
                     if site == FC2), None)
    out = {}
    for key in keys:
        recs = [s.sites.get(key) if s is not None else None for s in samples]
        sg = _assemble_site(key, recs, status, dest, tokens, rows, topk)
        if sg is not None:
            out[key] = sg
    bad = Counter(s for s in status if s != "ok")
    if bad:
        logger.info("guidance rejected for %d of %d samples: %s", sum(bad.values()), B, dict(bad))
    add_counts(counter, rows)
    return out


def check_counter(counter) -> None:
    """``counter`` is a ``FallbackCounter`` (checked before any work: the counts are added at the end)."""
    if not isinstance(counter, FallbackCounter):
        raise TypeError(f"counter must be a FallbackCounter, got {type(counter).__name__}")


def check_keys(keys: Sequence[SiteKey] | None) -> list[SiteKey] | None:
    """``keys`` (an assembly's guided keys) as distinct (layer, site) tuples: each layer an int >= 0, each site one of
    ``config.ACTIVATION_SITES``; None stays None. A key given twice was assembled and counted twice (coverage read
    from doubled rows), a site no record can have (a misspelt one) counted every token ``missing``, and a [layer, site]
    list failed as 'unhashable type'."""
    if keys is None:
        return None
    if isinstance(keys, tuple) and len(keys) == 2 and isinstance(keys[1], str):
        raise ValueError(f"keys={keys!r} is one key: give a list of (layer, site) keys")
    out = []
    for k in keys:
        if not (isinstance(k, (tuple, list)) and len(k) == 2 and is_integer(k[0]) and int(k[0]) >= 0
                and k[1] in ACTIVATION_SITES):
            raise ValueError(f"keys: {k!r} is not a (layer, site) key: a layer int >= 0 and a site of "
                             f"{ACTIVATION_SITES}")
        out.append((int(k[0]), k[1]))
    dup = sorted(k for k, n in Counter(out).items() if n > 1)
    if dup:
        raise ValueError(f"keys name {dup} more than once: each guided key is assembled and counted once")
    return out


def add_counts(counter: FallbackCounter, rows: FallbackCounter) -> None:
    """Add an assembly's own counts ``rows`` to the caller's ``counter``, as the call returns: an assembly that raised
    half-way (a key it cannot count, e.g. an FC2 key without records and without ``topk``) had counted the keys
    before it, and its retry counted them twice."""
    counter.add(rows.used, dict(rows.fallback))


def count_all_missing(tokens: Sequence[int], counter: FallbackCounter) -> None:
    """No sample of a micro-batch has guidance and the caller named no keys: every token counts as ``missing``
    once (the sites are unknown), so coverage reads 0, not 1."""
    if sum(tokens):
        logger.warning("no guidance for any of the %d samples of this micro-batch", len(tokens))
        counter.add(0, {"missing": sum(tokens)})


def missing_rows_per_token(key: SiteKey, topk: int | None, tokens: int) -> int:
    """Rows per token the trainer's layer quantizes at ``key`` (what it counts when the key has no record): one
    at FC1 and KV (a token's KV heads share one flag), ``topk`` at FC2 (one per token and chosen expert)."""
    if key[1] != FC2 or not tokens:
        return 1
    if topk is None:
        raise ValueError(f"guided key {key} has no record for the {tokens} tokens of this micro-batch and no FC2 "
                         "record gives the top-k: pass topk= (the router's top-k) to count its rows")
    return int(topk)


def check_topk(topk) -> None:
    """``topk`` is None or an int >= 1."""
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, numbers.Integral) or topk < 1):
        raise ValueError(f"topk={topk!r} must be an int >= 1 (the router's top-k) or None")


def destinations(mask: torch.Tensor, layout: PackedLayout | None) -> tuple[tuple[int, int], list, torch.device]:
    """(the assembled tensors' leading shape, per batch row b: (its row there, its tokens' positions in that row),
    their device): [B, S] and ``mask``'s positions, or with ``layout`` [1, T] and each sample's segment."""
    if layout is None:
        return tuple(mask.shape), [(b, row.nonzero().squeeze(1)) for b, row in enumerate(mask)], mask.device
    packed = as_layout(layout).positions(mask)[1].split(mask.sum(1).tolist())  # (row-major: sample by sample)
    return (1, layout.total), [(0, pos) for pos in packed], mask.device


def _assemble_site(key, recs, status, dest, tokens, counter, topk=None) -> SiteGuidance | None:
    layouts = Counter(r.layout() for r in recs if r is not None)
    if not layouts:
        n = sum(tokens)
        counter.add(0, {"missing": n * missing_rows_per_token(key, topk, n)})
        return None
    layout = layouts.most_common(1)[0][0]
    t = next(r for r in recs if r is not None and r.layout() == layout)
    rows_per_token = int(torch.tensor(t.valid.shape[1:]).prod().item())
    buf = _empty_like_batch(t, dest[0], dest[2])
    for b, rec in enumerate(recs):
        reason = status[b] if status[b] != "ok" else ("missing" if rec is None else None)
        if reason is None and (rec.layout() != layout or rec.num_tokens != tokens[b]):
            reason = "shape"
        if reason is not None:
            counter.add(0, {reason: tokens[b] * rows_per_token})
            continue
        _fill(buf, *dest[1][b], rec)
        used = int(rec.valid.sum())
        counter.add(used, {"not_recorded": rec.valid.numel() - used})
    record = with_tensors(
        t.record, buf["payload"], buf["scales"].view(t.record.block_scales.dtype), buf["amax"],
        (*dest[0], *t.record.shape[1:]),
    )
    return reject_bad_scales(key, SiteGuidance(record, buf["valid"], buf["ids"]), counter)


def scales_ok(sg: SiteGuidance) -> torch.Tensor:
    """bool, ``sg.valid``'s shape: the row's block scales and global amax are finite, >= 0 and of a kind some
    quantizer writes (``formats.tensor.scales_usable``; no host sync). Few ops: a trainer fed records that were not
    assembled runs this for every site at each step's start, when the GPU waits for the host."""
    ok = scales_usable(sg.record.block_scales, sg.record.global_amax)
    if ok.dim() > sg.valid.dim():  # a KV token's heads share one valid flag
        ok = ok.flatten(sg.valid.dim()).all(-1)
    return ok


def reject_bad_scales(key: SiteKey, sg: SiteGuidance, counter: FallbackCounter) -> SiteGuidance:
    """``sg`` with its valid rows whose block scales or global amax are NaN, Inf, negative or of no quantizer's kind
    (``scales_ok``) made invalid (a corrupt record, or an engine that quantized a non-finite row): counted as used
    before, now ``bad_scale``."""
    ok = scales_ok(sg)
    bad = int((sg.valid & ~ok).sum())
    if not bad:
        return replace(sg, scales_checked=True)
    logger.warning("guidance %s: %d valid rows have a NaN, Inf, negative or impossible scale or amax (scales_ok): "
                   "rejected", key, bad)
    counter.used -= bad
    counter.add(0, {"bad_scale": bad})
    return replace(sg, valid=sg.valid & ok, scales_checked=True)


def _empty_like_batch(t: SiteRecord, lead: tuple[int, int], dev) -> dict:
    """Zero tensors [*lead, ...] ([B, S] or a packed row's [1, T]) shaped like template record ``t``'s rows."""
    B, S = lead
    r = t.record

    def z(x, dtype=None):
        return torch.zeros((B, S, *x.shape[1:]), dtype=dtype or x.dtype, device=dev)

    amax = None
    if r.global_amax is not None:
        amax = torch.zeros((B, S, *r.block_scales.shape[1:-1], 1), dtype=torch.float32, device=dev)
    return dict(
        payload=z(payload_of(r)), scales=z(r.block_scales, torch.uint8), amax=amax, valid=z(t.valid),
        ids=None if t.expert_ids is None else z(t.expert_ids, torch.int64),
    )


def _fill(buf: dict, b: int, pos: torch.Tensor, rec: SiteRecord) -> None:
    dev = pos.device
    r = rec.record
    buf["payload"][b].index_copy_(0, pos, payload_of(r).to(dev))
    buf["scales"][b].index_copy_(0, pos, r.block_scales.view(torch.uint8).to(dev))
    if buf["amax"] is not None:
        g = r.global_amax.to(device=dev, dtype=torch.float32)
        g = g.expand(buf["amax"][b, : pos.numel()].shape) if g.dim() == 0 else g  # per tensor -> per row
        buf["amax"][b].index_copy_(0, pos, g.contiguous())
    buf["valid"][b].index_copy_(0, pos, rec.valid.to(dev))
    if buf["ids"] is not None:
        buf["ids"][b].index_copy_(0, pos, rec.expert_ids.to(dev, torch.int64))  # (an engine's may be narrower)


def staleness_stats(trainer_version: int, sample_versions: Sequence[int], prefix: str = "guidance") -> dict:
    """Distribution of ``trainer_version - sample_version`` over the samples of a step."""
    if not is_integer(trainer_version):  # (3.5 and "3" were truncated or parsed, as a version 3.7 was)
        raise ValueError(f"trainer_version={trainer_version!r} must be an int")
    versions = _ints(sample_versions, lambda: f"sample_versions={sample_versions!r} must be ints")
    st = [int(trainer_version) - v for v in versions]
    if any(s < 0 for s in st):
        raise ValueError(f"sample versions {list(sample_versions)} newer than trainer version {trainer_version}")
    if not st:
        return {f"{prefix}/staleness_mean": 0.0, f"{prefix}/staleness_max": 0.0}
    d = {f"{prefix}/staleness_mean": sum(st) / len(st), f"{prefix}/staleness_max": float(max(st))}
    for s, n in sorted(Counter(st).items()):
        d[f"{prefix}/staleness_frac_{s}"] = n / len(st)
    return d
