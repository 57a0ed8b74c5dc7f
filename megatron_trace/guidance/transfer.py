"""What a guidance transfer carries and reports (``guidance.sync``): per-sample units of guidance and routing, their
chunks of at most ``chunk_bytes``, the samples per destination rank, the receiver's ``GuidanceShard`` of columns and
``TransferStats``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from . import wire
from .layout import PackedLayout
from .packed import PackedGuidance, PackedRouting, source_of
from .packed_assemble import assemble_packed, assemble_routing_packed
from .records import SampleGuidance
from .routing import SampleRouting
from .site import FallbackCounter, SiteGuidance, SiteKey


@dataclass
class TransferStats:
    """One ``send`` or ``receive`` on this rank: payload bytes, messages and the peak transfer memory."""

    samples: int = 0
    payload_bytes: int = 0
    chunks: int = 0
    peak_bytes: int = 0
    """Most bytes the transfer's own buffers (headers, payloads) held at once on this rank."""

    def as_dict(self, prefix: str = "guidance_sync") -> dict[str, float]:
        return {f"{prefix}/samples": float(self.samples), f"{prefix}/payload_bytes": float(self.payload_bytes),
                f"{prefix}/chunks": float(self.chunks), f"{prefix}/peak_bytes": float(self.peak_bytes)}


class GuidanceShard:
    """What one trainer rank received: its samples' guidance and routing, as columns (one part per chunk)."""

    def __init__(self):
        self.parts: list[PackedGuidance] = []
        self.routing_parts: list[PackedRouting] = []
        self.stats = TransferStats()
        self._samples: list[SampleGuidance] | None = None
        self._routing: list[SampleRouting] | None = None

    @property
    def samples(self) -> list[SampleGuidance]:
        """Per-sample views of the received guidance, in send order (built on first use)."""
        if self._samples is None:
            self._samples = [s for p in self.parts for s in p.to_samples()]
        return self._samples

    @property
    def routing(self) -> list[SampleRouting]:
        """Per-sample views of the received routing, in send order: the guidance's samples first, then routing-only
        ids (built on first use)."""
        if self._routing is None:
            self._routing = [r for p in self.routing_parts for r in p.to_samples()]
        return self._routing

    def assemble(self, sample_ids: Sequence[int | None], token_ids: torch.Tensor, *, versions: int | Sequence[int],
                 counter: FallbackCounter, attention_mask: torch.Tensor | None = None, lengths=None,
                 keys: Sequence[SiteKey] | None = None, topk: int | None = None,
                 layout: PackedLayout | None = None) -> dict[SiteKey, SiteGuidance]:
        """``records.assemble`` for a micro-batch whose row b trains sample ``sample_ids[b]`` (None: none), straight
        from the columns (same checks, counts and result, no per-sample work). ``keys``: the trainer's guided
        keys (None: every key of the received parts, ``packed_assemble.assemble_packed``), ``topk``: its router
        top-k (the rows of an FC2 key no sample has); ``layout``: a packed row's ``guidance.layout.PackedLayout``
        (the guidance then comes as [1, T, ...])."""
        return assemble_packed(self.parts, sample_ids, token_ids, versions=versions, counter=counter,
                               attention_mask=attention_mask, lengths=lengths, keys=keys, topk=topk, layout=layout)

    def assemble_routing(self, sample_ids: Sequence[int | None], token_ids: torch.Tensor, *,
                         versions: int | Sequence[int], attention_mask: torch.Tensor | None = None,
                         lengths=None, layout: PackedLayout | None = None) -> dict[int, torch.Tensor]:
        """``routing.assemble_routing`` for row b = sample ``sample_ids[b]``, straight from the columns (with
        ``layout``: [1, T, topk])."""
        return assemble_routing_packed(self.routing_parts, sample_ids, token_ids, versions=versions,
                                       attention_mask=attention_mask, lengths=lengths, layout=layout)


@dataclass
class _Unit:
    """A sample's guidance and/or routing: what travels to one rank together."""

    sample_id: int
    guidance: SampleGuidance | None = None
    routing: SampleRouting | None = None

    def nbytes(self) -> int:
        return _nbytes(self.guidance) + _nbytes(self.routing)


def _nbytes(s: SampleGuidance | SampleRouting | None) -> int:
    if s is None:
        return 0
    src = source_of([s])  # a view of split_batch / split_routing columns: bytes from the column shapes
    if src is not None:
        return src[0].sample_nbytes[src[1][0]]
    if isinstance(s, SampleGuidance):
        wire.check_sites(s)
    return s.nbytes()


def _units(samples: Sequence[SampleGuidance], routing: Sequence[SampleRouting]) -> list[_Unit]:
    units: dict[int, _Unit] = {}
    for s in samples:
        if s.sample_id in units:
            raise ValueError(f"sample {s.sample_id} appears twice in the guidance to send")
        units[s.sample_id] = _Unit(s.sample_id, guidance=s)
    for r in routing:
        u = units.setdefault(r.sample_id, _Unit(r.sample_id))
        if u.routing is not None:
            raise ValueError(f"sample {r.sample_id} appears twice in the routing to send")
        u.routing = r
    return list(units.values())


def chunk_units(units: Sequence[_Unit], chunk_bytes: int | None) -> list[list[_Unit]]:
    """Consecutive groups of at most ``chunk_bytes`` (None: one group); always >= 1 group."""
    if chunk_bytes is None:
        return [list(units)]
    chunks, cur, size = [], [], 0
    for u in units:
        n = u.nbytes()
        if cur and size + n > chunk_bytes:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += n
    return chunks + [cur] if cur or not chunks else chunks


def assign_destinations(
    samples: Sequence[SampleGuidance],
    dsts: Sequence[int],
    destination: Mapping[int, int] | Callable[[int], int] | None = None,
) -> dict[int, list[SampleGuidance]]:
    """Samples per destination rank (every rank in ``dsts`` present, possibly empty)."""
    out: dict[int, list[SampleGuidance]] = {d: [] for d in dsts}
    for i, s in enumerate(samples):
        if destination is None:
            d = dsts[i % len(dsts)]
        elif isinstance(destination, Mapping):
            if s.sample_id not in destination:
                raise ValueError(f"destination mapping has no rank for sample {s.sample_id}")
            d = destination[s.sample_id]
        else:
            d = destination(s.sample_id)
        if d not in out:
            raise ValueError(f"sample {s.sample_id} mapped to rank {d}, which is not a trainer rank {list(dsts)}")
        out[d].append(s)
    return out
