"""Per-sample routing (the rollout's expert choices, replayed by R3), sharded like the guidance records.

A batch's routing ``{layer: int64 [B, S, topk]}`` is cut into one ``SampleRouting`` per sequence
(token positions only, expert ids stored as uint8 when there are <= 256 experts: 1 byte per
(token, layer, slot), prime-rl#2808), travels with that sample's guidance to the one trainer rank
that trains it (``GuidanceSync.send(..., routing=...)``; never broadcast whole, slime#2384) and is
re-assembled per micro-batch by ``assemble_routing``. Routing has no per-row fallback (Megatron
replays whole batches), so a sample whose routing is missing or belongs to other tokens or another
policy version raises ``RoutingMismatchError`` naming the sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .layout import PackedLayout
from .records import _ints, _per_row, destinations, is_integer, token_hash, token_mask

ALIGN = 16
_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}
ID_DTYPES = tuple(_DTYPES.values())
"""Dtypes of expert ids a ``SampleRouting`` (and the sync) carries: integers that hold ids >= 0 exactly."""


class RoutingMismatchError(ValueError):
    """Routing that does not belong to the trainer batch's sample (missing, other tokens or version)."""


def id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding expert ids 0..num_experts-1."""
    if not is_integer(num_experts) or not 1 <= num_experts <= 2**31:  # (1.5 and True were taken; 2**40 as int32)
        raise ValueError(f"num_experts={num_experts!r} must be an int in [1, 2**31]")
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32768 else torch.int32


@dataclass(frozen=True)
class SampleRouting:
    """Expert choices of one sequence: ``experts[layer]`` [L, topk] over its L tokens."""

    sample_id: int
    version: int
    token_hash: str
    num_tokens: int
    experts: dict[int, torch.Tensor]
    source: tuple | None = field(default=None, compare=False, repr=False)
    """(``packed.PackedRouting``, index) when the tensors are views of one (``split_routing``, a received chunk)."""

    def __post_init__(self):
        if self.source is not None:  # views of columns checked when they were packed or received
            return
        for layer, t in self.experts.items():
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise ValueError(f"routing of sample {self.sample_id}: layer {layer!r} must be an int layer id")
            if t.dtype not in ID_DTYPES or t.dim() != 2:
                raise ValueError(f"routing of sample {self.sample_id} layer {layer}: expert ids {t.dtype} "
                                 f"{tuple(t.shape)} must be [tokens, topk] of {', '.join(map(str, ID_DTYPES))}")

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.experts.values())


def split_routing(routing: Mapping[int, torch.Tensor], token_ids: torch.Tensor, *, version: int | Sequence[int],
                  num_experts: int, attention_mask: torch.Tensor | None = None, lengths=None,
                  sample_ids: Sequence[int] | None = None) -> list[SampleRouting]:
    """Cut ``{layer: [B, S, topk]}`` into one compact ``SampleRouting`` per batch row: views into one
    ``packed.PackedRouting`` gathered once per layer (copies of the token rows: the batch can be freed)."""
    from .packed import pack_routing

    mask = token_mask(token_ids, attention_mask=attention_mask, lengths=lengths)  # [B, S]
    B, S = mask.shape
    dtype = id_dtype(num_experts)
    for layer, r in routing.items():
        if not is_integer(layer):  # (a layer "0" was carried, never replayed by layer 0)
            raise ValueError(f"routing has layer {layer!r}: layers are int layer ids")
        if not isinstance(r, torch.Tensor) or r.is_floating_point() or r.is_complex() or r.dtype == torch.bool:
            # (float ids were cast to the id dtype: 2.7 replayed as expert 2, silently)
            raise ValueError(f"routing[{layer}] must be an integer tensor of expert ids, got "
                             f"{r.dtype if isinstance(r, torch.Tensor) else type(r).__name__}")
        if r.dim() != 3 or tuple(r.shape[:2]) != (B, S):
            raise ValueError(f"routing[{layer}] has shape {tuple(r.shape)}, token_ids {(B, S)}: need [B, S, topk]")
        kept = r[mask.to(r.device)]  # padding positions are dropped: any value there is fine
        bad = (kept < 0) | (kept >= num_experts)
        if bool(bad.any()):
            raise ValueError(f"routing[{layer}] holds expert id {int(kept[bad][0])} at a token position: expert ids "
                             f"are 0..{num_experts - 1}")
    versions = _per_row(version, B, "version")
    ids = list(range(B)) if sample_ids is None else \
        _ints(sample_ids, lambda: f"sample_ids={sample_ids!r}: give {B} distinct int ids")  # (3.5: not sample 3)
    if len(versions) != B or len(ids) != B or len(set(ids)) != B:
        raise ValueError(f"need {B} versions and {B} distinct sample_ids, got {versions} and {ids}")
    return pack_routing(routing, token_ids, mask, versions, ids, dtype).to_samples()


def assemble_routing(samples: Sequence[SampleRouting | None], token_ids: torch.Tensor, *,
                     versions: int | Sequence[int], attention_mask: torch.Tensor | None = None,
                     lengths=None, layout: PackedLayout | None = None) -> dict[int, torch.Tensor]:
    """``{layer: int64 [B, S, topk]}`` for a trainer micro-batch (``samples[b]`` is row b; zeros on padding); with
    ``layout`` (a ``guidance.layout.PackedLayout``) the packed row's [1, T, topk]."""
    mask = token_mask(token_ids, attention_mask=attention_mask, lengths=lengths)
    B = mask.shape[0]
    if len(samples) != B:
        raise ValueError(f"{len(samples)} routing samples for a batch of {B} rows")
    lead, dest, _ = destinations(mask, layout)
    vers = _per_row(versions, B, "versions")
    layers, topk = None, {}
    for b, s in enumerate(samples):
        problem = _problem(s, token_ids[b, mask[b]], vers[b])
        if problem is None and layers is not None and set(s.experts) != layers:
            problem = f"layers {sorted(s.experts)} != {sorted(layers)} of the other samples"
        if problem is None:
            ks = {layer: t.shape[-1] for layer, t in s.experts.items()}
            diff = [layer for layer in ks if topk.setdefault(layer, ks[layer]) != ks[layer]]
            if diff:
                problem = (f"layer {diff[0]} has top-{ks[diff[0]]} expert ids, the other samples top-"
                           f"{topk[diff[0]]}")
        if problem is not None:
            raise RoutingMismatchError(f"routing for batch row {b}: {problem}; routing replay needs every sample")
        layers = set(s.experts)
    out = {}
    for layer in sorted(layers or ()):
        topk = samples[0].experts[layer].shape[-1]
        t = torch.zeros(*lead, topk, dtype=torch.int64, device=mask.device)
        for (row, pos), s in zip(dest, samples):
            t[row].index_copy_(0, pos, s.experts[layer].to(mask.device, torch.int64))
        out[layer] = t
    return out


def _problem(s: SampleRouting | None, tokens: torch.Tensor, version: int) -> str | None:
    if s is None:
        return "missing"
    if s.token_hash != token_hash(tokens):
        return f"sample {s.sample_id} was recorded for other tokens (token_hash)"
    if s.version != version:
        return f"sample {s.sample_id} has version {s.version}, the trainer expects {version}"
    return None


# ---- flat layout (the planner's byte sizes) -------------------------------------------------------
def plan_routing(samples: Sequence[SampleRouting]) -> tuple[list[dict], int]:
    """(metas with each tensor's offset, total bytes) of ``samples`` laid out flat, each tensor 16-byte aligned
    (``planner.sample_bytes``'s ``routing``; ``GuidanceSync`` sends routing in columns, ``guidance.wire``)."""
    metas, off = [], 0
    for s in samples:
        table = []
        for layer, t in sorted(s.experts.items()):
            table.append([layer, _NAMES[t.dtype], list(t.shape), off])
            off = -(-(off + t.nbytes) // ALIGN) * ALIGN
        metas.append({"sample_id": s.sample_id, "version": s.version, "token_hash": s.token_hash,
                      "num_tokens": s.num_tokens, "tensors": table})
    return metas, off
