"""Collects what a rollout did, step by step, and lays it out batch-major for the trainer.

During generation every forward call (the prefill, then one decode step per token) adds,
per MoE layer, the expert choices and, per selected (layer, site), the quantized rows as a
guidance record. ``finish`` concatenates the steps along the sequence and re-indexes them from
the internal left-padded layout to the right-padded ``RolloutBatch`` layout.

K/V sites stored by an FP4 KV cache are recorded from the cache instead (``add_kv_history``): the cache keeps
every position's codes, scales and amax anyway, so ``finish`` takes the stored history once. A decode step then
records nothing for them: no per-step copy of the token's scales out of the cache rows it was written into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..config import ACTIVATION_SITES
from ..formats import CompactGuidance, FP4Tensor, FullGuidance
from ..guidance.site import SiteGuidance, SiteKey
from ..kernels import compact_guidance
from ..kernels.dispatch import parse_kernel
from .base import check_bools, check_count, is_int
from .recorder_static import StaticSteps

Record = FullGuidance | CompactGuidance
_PAYLOAD = {FullGuidance: "codes", CompactGuidance: "mantissa_bits"}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # float8 tensors lack gather/where on CPU: move them around as their bytes
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t


def map_record(rec: Record, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...]) -> Record:
    """Apply ``fn`` to every tensor of ``rec`` (leading dims only) and set its ``shape``."""
    payload = _PAYLOAD[type(rec)]
    scales = fn(_as_bytes(rec.block_scales)).view(rec.block_scales.dtype)
    amax = None if rec.global_amax is None else fn(rec.global_amax)
    return dataclasses.replace(
        rec, block_scales=scales, global_amax=amax, shape=tuple(shape), **{payload: fn(getattr(rec, payload))}
    )


def _per_row_amax(rec: Record) -> Record:
    """A per-tensor (0-d) global amax as the same value on every row ([..., 1]): one step's record is one chunk
    of the sequence (a prefill, one token), each with its own amax, and the chunks are concatenated (``finish``),
    as ``FP4KVCache`` stores them (``TraceConfig(activation_amax="per_tensor")``)."""
    g = rec.global_amax
    if g is None or g.dim():
        return rec
    return dataclasses.replace(rec, global_amax=g.reshape([1] * len(rec.shape)).expand(*rec.shape[:-1], 1))


def cat_records(recs: list[Record], dim: int) -> Record:
    """Concatenate records along a leading ``dim``."""
    first = recs[0]
    payload = _PAYLOAD[type(first)]
    shape = list(first.shape)
    shape[dim] = sum(r.shape[dim] for r in recs)
    scales = torch.cat([_as_bytes(r.block_scales) for r in recs], dim).view(first.block_scales.dtype)
    amax = None if first.global_amax is None else torch.cat([r.global_amax for r in recs], dim)
    data = torch.cat([getattr(r, payload) for r in recs], dim)
    return dataclasses.replace(first, block_scales=scales, global_amax=amax, shape=tuple(shape), **{payload: data})


def take_positions(t: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``t`` [B, T, ...] -> [B, S, ...] at positions ``index`` [B, S]; zeros where ``valid`` is False."""
    b, s = index.shape
    rest = t.shape[2:]
    idx = index.reshape(b, s, *([1] * len(rest))).expand(b, s, *rest)
    out = t.gather(1, idx)
    keep = valid.reshape(b, s, *([1] * len(rest)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


class GuidanceRecorder:
    """Step-wise store of routing choices and guidance records for one ``generate`` call.

    ``kernel`` ("auto" | "triton" | "reference") computes the compact records: on CUDA one Triton launch
    per record and step, with no host sync (a sync per record stalled every decode step)."""

    def __init__(self, batch_size: int, sites: set[SiteKey], compact: bool, kernel: str = "auto"):
        # (compact="no" recorded compact records; a batch of 2.0 rows or a site (layer "0", ...) that no forward
        # asks for was taken, and the site's records were missing from the batch)
        self.batch_size = check_count("GuidanceRecorder.batch_size", batch_size)
        check_bools("GuidanceRecorder", compact=compact)
        parse_kernel(kernel)
        bad = [k for k in sites if not (isinstance(k, tuple) and len(k) == 2 and is_int(k[0]) and k[0] >= 0
                                        and k[1] in ACTIVATION_SITES)]
        if bad:
            raise ValueError(f"GuidanceRecorder.sites has {bad[0]!r}: a site is (layer >= 0, one of "
                             f"{ACTIVATION_SITES})")
        self.sites = set(sites)
        self.compact = compact
        self.kernel = kernel
        self._records: dict[SiteKey, list[Record]] = {key: [] for key in self.sites}
        self._routing: dict[int, list[torch.Tensor]] = {}
        self._valid: list[torch.Tensor] = []
        self._histories: dict[SiteKey, Callable[[], FP4Tensor]] = {}
        self._static: StaticSteps | None = None  # fixed-buffer decode steps (begin_static)

    def wants(self, layer: int, site: str) -> bool:
        return (layer, site) in self.sites

    def _record(self, q: FP4Tensor, record: CompactGuidance | None) -> Record:
        if not self.compact:
            rec = q.guidance(compact=False)
        else:
            rec = compact_guidance(q, kernel=self.kernel) if record is None else record
        return _per_row_amax(rec)

    def _rows_to_batch(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.batch_size, -1, *t.shape[1:])  # [B*t, ...] -> [B, t, ...]

    def begin_static(self, steps: int, device: torch.device) -> torch.Tensor:
        """From now on each forward call is one fixed-buffer decode step (``rollout.static_decode``): its records
        and routing go into buffers of ``steps`` steps at the returned step index (int64 [1] on ``device``; the
        caller sets it before each step), so a CUDA graph of one step replays the writes. ``end_step`` counts the
        steps. Returns the index."""
        if self._static is not None:
            raise ValueError("begin_static was already called for this recorder")
        self._static = StaticSteps(steps, device)
        return self._static.index

    def add_routing(self, layer: int, top_k_index: torch.Tensor) -> None:
        """``top_k_index`` int [B*t, topk] of this step."""
        ids = self._rows_to_batch(top_k_index.long())
        if self._static is not None:
            self._static.put(("routing", layer), ids)
        else:
            self._routing.setdefault(layer, []).append(ids)

    def add_rows(self, layer: int, site: str, q: FP4Tensor, record: CompactGuidance | None = None) -> None:
        """Quantized rows with leading dim ``B*t`` (token-major), e.g. [B*t, hidden]. ``record``: their compact
        record when the quantize pass already wrote it (used only in compact mode)."""
        if not self.wants(layer, site):
            return
        self._check_no_history((layer, site))
        shape = (self.batch_size, q.shape[0] // self.batch_size, *q.shape[1:])
        rec = map_record(self._record(q, record), self._rows_to_batch, shape)
        if self._static is not None:
            self._static.put((layer, site), rec)
        else:
            self._records[(layer, site)].append(rec)

    def add_heads_major(self, layer: int, site: str, q: FP4Tensor, record: CompactGuidance | None = None) -> None:
        """Quantized K or V rows [B, heads, t, head_dim], recorded batch-major [B, t, heads, head_dim]."""
        if self.wants(layer, site):
            self._check_no_history((layer, site))
            if self._static is not None:
                raise ValueError("per-step K/V records (SGLang's KV format) cannot be kept in static steps")
            b, h, t, d = q.shape
            self._records[(layer, site)].append(
                map_record(self._record(q, record), lambda x: x.transpose(1, 2).contiguous(), (b, t, h, d)))

    def _check_no_history(self, key: SiteKey) -> None:
        if key in self._histories:  # (``finish`` would take the history and drop per-step records)
            raise ValueError(f"site {key} is recorded from its stored history; it cannot also have per-step records")

    def add_kv_history(self, layer: int, site: str, history: Callable[[], FP4Tensor]) -> None:
        """Record K or V site ``(layer, site)`` from its store: ``history()`` gives the stored rows
        [B, heads, T, head_dim] of every position so far (prefill and decode steps, forked with the batch like
        this recorder's rows), called once in ``finish``. Calling it again (every step) keeps the first source."""
        key = (layer, site)
        if key in self.sites and self._records[key]:
            raise ValueError(f"site {key} already has per-step records; it cannot also be recorded from a history")
        if key in self.sites:
            self._histories.setdefault(key, history)

    def _history_record(self, key: SiteKey) -> Record:
        """The record of a K/V site's stored history, batch-major [B, T, heads, head_dim]."""
        q = self._histories[key]()
        n = self.recorded_positions
        if q.shape[2] != n:
            raise ValueError(f"the stored history of {key} has {q.shape[2]} positions but {n} were recorded: "
                             "the cache and the recorder must see the same forward calls")
        b, h, t, d = q.shape
        return map_record(self._record(q, None), lambda x: x.transpose(1, 2).contiguous(), (b, t, h, d))

    def site_records(self, key: SiteKey) -> list[Record]:
        """Site ``key``'s records so far, batch-major [B, t, ...] chunks along the sequence (a K/V site recorded
        from its store: one chunk of every position, read from the store now)."""
        if key in self._histories:
            return [self._history_record(key)]
        return list(self._records[key]) + self._static_chunks(key)

    def _static_chunks(self, key) -> list:
        return [] if self._static is None else self._static.chunks(key)

    def end_step(self, valid: torch.Tensor) -> None:
        """bool [B, t]: which of this step's input positions hold real tokens."""
        self._valid.append(valid.bool())
        if self._static is not None:
            if self._static.count == self._static.steps:
                raise ValueError(f"more than the {self._static.steps} static steps begin_static allowed")
            self._static.count += 1

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (int64 [B']) of everything recorded so far; repeats fork a row
        (prefix reuse: rows of a shared prompt are computed once, then copied per sample)."""
        index = index.long()
        sel = lambda t: t.index_select(0, index.to(t.device)) if t.dim() else t  # noqa: E731
        for key, chunks in self._records.items():
            self._records[key] = [map_record(r, sel, (index.numel(), *r.shape[1:])) for r in chunks]
        self._routing = {layer: [sel(t) for t in chunks] for layer, chunks in self._routing.items()}
        self._valid = [sel(v) for v in self._valid]
        if self._static is not None:
            self._static.select(index)
        self.batch_size = index.numel()

    @property
    def recorded_positions(self) -> int:
        return sum(v.shape[1] for v in self._valid)

    def finish(self, index: torch.Tensor, valid: torch.Tensor
               ) -> tuple[dict[int, torch.Tensor], dict[SiteKey, SiteGuidance]]:
        """Re-index to the output layout: ``index`` [B, S] internal positions, ``valid`` [B, S]. Every routing layer
        and site must hold one record per position that ``end_step`` counted (a record of a step without its
        ``end_step``, or a step without a layer's record, would be gathered at other positions: refused)."""
        n = self.recorded_positions
        ok = valid & (index < n) & take_positions(torch.cat(self._valid, 1), index.clamp(max=n - 1), valid)
        idx = index.clamp(max=n - 1)
        static = self._static.keys() if self._static is not None else ()
        layers = sorted(set(self._routing) | {k[1] for k in static if k[0] == "routing"})
        routing = {}
        for layer in layers:
            ids = torch.cat(self._routing.get(layer, []) + self._static_chunks(("routing", layer)), 1)
            routing[layer] = take_positions(_positions(f"layer {layer}'s routing", ids, n), idx, ok)
        guidance = {}
        for layer, site in self._records:
            chunks = self.site_records((layer, site))
            if not chunks:
                continue
            rec = _positions(f"site {(layer, site)}", cat_records(chunks, 1), n)
            out_shape = (*idx.shape, *rec.shape[2:])
            rec = map_record(rec, lambda t: take_positions(t, idx, ok), out_shape)
            if site == "expert_fc2_in":
                ids = routing[layer]
                guidance[(layer, site)] = SiteGuidance(rec, ok.unsqueeze(-1).expand_as(ids).clone(), ids)
            else:
                guidance[(layer, site)] = SiteGuidance(rec, ok.clone())
        return routing, guidance


def _positions(what: str, t, n: int):
    """``t`` (a tensor or record, batch-major [B, positions, ...]) when it holds ``n`` positions."""
    if t.shape[1] != n:
        raise ValueError(f"{what} has {t.shape[1]} recorded positions but end_step counted {n}: each forward call "
                         "must record every layer and site once, then call end_step once")
    return t
