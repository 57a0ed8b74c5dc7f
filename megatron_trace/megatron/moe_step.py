"""One MoE layer during a TRACE step: routing replay, guidance rows that follow the tokens, recording.

Hooks on Megatron's router (registered by ``trace_guidance`` for the step, removed after) see the
pre-dispatch tokens [S, B, H] and the routing map [T, E] (T = S * B, token ``t = s * B + b``):

* before the router: set Megatron's ``RouterReplay`` target (replay) or its record action;
* after the router: count FC1 rows per token; build one *virtual token* per (token, chosen expert)
  carrying that row's guidance bytes (FC1 record of the token, FC2 record of the rollout slot
  with the same expert, or none), routed to exactly that expert.

The experts (``TraceExpertsCore``) move the virtual tokens with a second instance of the layer's
own dispatcher class (top-1, same splits and the same expert-major order as the real tokens), so
each expert-parallel rank receives exactly the guidance rows of the (token, expert) rows it
computes. Recording FC2 runs the same dispatcher's combine path backwards. Without expert or
expert-tensor parallelism the rows never leave the rank: the experts' permutation then gathers them
straight from the records (no bytes encoded, moved and decoded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from ..formats import FP4Tensor
from ..kernels import abs_max
from .gemm import to_device_async
from .rows import (
    Record,
    RowCodec,
    RowGuidance,
    as_decoded,
    decode_amax,
    encode_amax,
    map_record,
    take,
    take_record,
)
from .sites import quantize_rows_recorded
from .step import (
    EXPERT_MISMATCH,
    INVALID,
    NOT_GUIDED,
    SHAPE,
    CheckedSite,
    GuidanceFallbackError,
    StepState,
    counted_sum,
    counted_total,
    counted_valid,
    flat_record,
    flat_rows,
    local_seq,
    site_on,
    site_pinned,
)

FC1, FC2 = "expert_fc1_in", "expert_fc2_in"


@dataclass
class ExpertRows:
    """Guidance aligned with the permuted rows an experts module computes ([N] rows)."""

    fc1: RowGuidance | None = None
    fc2: RowGuidance | None = None
    fc1_amax: torch.Tensor | None = None  # float32 [N, 1]: the source rank's per-tensor FC1 amax


@dataclass(frozen=True)
class _Gather:
    """The guidance rows of the virtual tokens, not yet gathered: row ``index[i]`` of ``record``, ``valid[i]``."""

    record: Record
    index: torch.Tensor  # int64 [Nv]
    valid: torch.Tensor  # bool [Nv]
    all_valid: bool = False  # valid is all True (``StepState.all_valid_flags``)

    def rows(self, order: torch.Tensor | None = None) -> RowGuidance:
        """The rows (in virtual-token order, or permuted by ``order``)."""
        if order is None:
            return RowGuidance(take_record(self.record, self.index), self.valid)
        rec = as_decoded(take_record(self.record, self.index.index_select(0, order)))
        return RowGuidance(rec, self.valid if self.all_valid else self.valid.index_select(0, order))


@dataclass
class _Forward:
    """Per-forward data prepared by the router hook."""

    tokens: int
    batch: int
    token: torch.Tensor  # int64 [Nv]: the token of each virtual token, token-major
    expert: torch.Tensor  # int64 [Nv]: its expert
    payload: torch.Tensor | None  # uint8 [Nv, C] (None: the rows stay on this rank, see ``gathers``)
    slots: torch.Tensor | None  # int64 [T, topk]: expert of each slot (when recording)
    gathers: dict | None = None  # site -> RowGuidance in the experts' order, when the rows stay on this rank
    counts: torch.Tensor | None = None  # with gathers: rows per local expert


def _virtual_experts(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """The experts of ``routing_map.nonzero()`` for a dropless routing map (exactly ``topk`` experts per token,
    which ``trace_guidance`` requires where rows are dispatched) without its host sync: [T * topk]; the
    tokens of those rows are ``_virtual_token_ids``."""
    return routing_map.to(torch.int8).topk(topk, dim=1).indices.sort(dim=1).values.reshape(-1)  # ascending


def _virtual_token_ids(tokens: int, topk: int, device) -> torch.Tensor:
    """int64 [T * topk]: 0, .., 0, 1, .., 1, ... (each token ``topk`` times)."""
    return torch.arange(tokens * topk, device=device).div(topk, rounding_mode="floor")


class MoEStep:
    """TRACE state of one ``MoELayer`` for one step (see the module docstring)."""

    def __init__(self, state: StepState, layer: int, moe, fc1: CheckedSite, fc2: CheckedSite, routing):
        self.state, self.layer, self.moe = state, layer, moe
        self.fc1, self.fc2, self.routing = fc1, fc2, routing
        cfg, mcfg = state.config, moe.config
        self.topk, self.num_experts = mcfg.moe_router_topk, mcfg.num_moe_experts
        self.guide_fc1 = state.is_guided(layer, FC1)
        self.guide_fc2 = state.is_guided(layer, FC2)
        self.per_tensor_fc1 = cfg.quantizes(FC1) and cfg.format == "nvfp4" and cfg.activation_amax == "per_tensor"
        self.recording_fc2 = state.recorder is not None and cfg.quantizes(FC2)
        # recording a stochastic trainer: the experts take the FC1 rows recorded per token (one draw per token), not
        # a draw of their own per (token, expert) copy, which the per-token record would not describe
        self.recorded_fc1 = state.recorder is not None and cfg.quantizes(FC1) and cfg.rounding == "stochastic"
        self.codecs = {}  # payload columns, identical on every rank (they depend on the config only)
        if self.guide_fc1 or self.recorded_fc1:
            self.codecs[FC1] = RowCodec(cfg.format, mcfg.hidden_size, state.compact)
        if self.guide_fc2:
            self.codecs[FC2] = RowCodec(cfg.format, mcfg.moe_ffn_hidden_size, state.compact)
        self.needs_dispatch = bool(self.codecs) or self.per_tensor_fc1 or self.recording_fc2
        # only guidance rows, all staying on this rank: gathered from the records, not moved as bytes
        self.local_rows = (bool(self.codecs) and not self.per_tensor_fc1 and not self.recording_fc2
                           and moe.experts._local_payload())
        self.back_codec = RowCodec(cfg.format, mcfg.moe_ffn_hidden_size, compact=False)  # recorded FC2 rows
        self.back_width = self.back_codec.width if self.recording_fc2 else 0
        self.routing_distinct = routing is None  # top-k distinct experts per token (replay: found per step)
        # site -> every guidance row dispatched to this rank's experts is valid, from every rank of the tensor/expert
        # parallel group (``facts.step_facts``; where rows cross ranks: ``checked.all_valid`` is this rank's own)
        self.received_all_valid: dict[str, bool] = {}
        self._fwd: _Forward | None = None
        self._replay_slots = None
        self._host: tuple[CheckedSite, CheckedSite] | None = None  # fc1, fc2 as given, while held (``hold``)

    def hold(self, device) -> None:
        """This micro-batch's records on ``device`` for its forward or recompute pass (``MicroBatchQueue``)."""
        if self._host is None:
            self._host = (self.fc1, self.fc2)
            self.fc1, self.fc2 = site_on(self.fc1, device), site_on(self.fc2, device)

    def pin(self) -> None:
        """The host records in pinned memory, once, before the step is first held (``MicroBatchQueue``)."""
        self.fc1, self.fc2 = site_pinned(self.fc1), site_pinned(self.fc2)

    def release(self) -> None:
        """Drop the forward's data and the device records (back to the host ones)."""
        self._fwd = None
        if self._host is not None:
            self.fc1, self.fc2 = self._host
            self._host = None

    # ---- router hooks --------------------------------------------------------------------------
    def _seq(self, hidden_seq: int, full_seq: int) -> slice:
        tp = self.moe.attn_tp_group
        return local_seq(hidden_seq, full_seq, tp.rank(), self.moe.config.sequence_parallel and tp.size() > 1)

    def router_pre_hook(self, router, args):
        hidden = args[0]
        rr = router.router_replay
        self._replay_slots = None
        if self.routing is not None:
            r = self.routing
            want = (hidden.shape[1], self._full_seq(hidden.shape[0]), self.topk)
            if tuple(r.shape) != want:  # (a longer sequence would replay another position's experts)
                raise ValueError(f"routing indices for layer {self.layer} have shape {tuple(r.shape)}; the batch "
                                 f"needs [B={want[0]}, S={want[1]}, topk={want[2]}]")
            seq = self._seq(hidden.shape[0], r.shape[1])
            token = self.state.token_index(r.shape[0], r.shape[1], seq, hidden.device)
            idx = r.to(hidden.device).reshape(-1, r.shape[2]).index_select(0, token)  # [T, topk]
            # (the index range of every layer was checked once for the step: ``trace_guidance``)
            rr.set_target_indices(idx)
            # (recompute passes replay from this step too, with REPLAY_FORWARD: Megatron's backward list, which
            # set_target_indices appends to, would keep every call's indices until the context exits)
            rr.replay_backward_list.clear()
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self._replay_slots = idx
        elif rr is not None:  # this micro-batch routes itself: no replay left from the one before it
            rr.clear_indices()
            rr.clear_router_replay_action()
            if self.state.recorder is not None:
                rr.set_router_replay_action(RouterReplayAction.RECORD)

    def router_hook(self, router, args, output):
        hidden = args[0]  # [S, B, H]
        _, routing_map = output  # [T, E] bool
        S, B = hidden.shape[0], hidden.shape[1]
        full_s = self._full_seq(S)
        seq = self._seq(S, full_s)
        count = self.state.counted(B, full_s, seq, hidden.device)  # None: every token counts
        token = self.state.token_index(B, full_s, seq, hidden.device)  # [T]: each token's batch-major row
        fc1 = self._fc1_rows(seq, B, full_s, count, token, hidden.device)  # batch-major rows [B * full_s]
        if not self.guide_fc2 and FC2 in self.state.config.guided_sites and self.state.config.quantizes(FC2):
            self.state.count(self.layer, FC2, 0, {NOT_GUIDED: counted_sum(routing_map, None if count is None
                                                                           else count[:, None])})
        self._fwd = None
        rec = self.state.recorder
        if rec is not None and self.state.config.quantizes(FC1):
            q1 = self._record_fc1(hidden.reshape(S * B, -1), None if fc1 is None else take(fc1, token), B)
            if self.recorded_fc1:  # (Megatron's token order: the virtual tokens' ``t`` index it)
                fc1 = RowGuidance(q1.guidance(self.state.compact), self.state.all_valid_flags(S * B, hidden.device))
        if self.needs_dispatch:
            self._fwd = self._virtual_tokens(router, hidden, routing_map, fc1, token, (B, full_s, seq), count)
        if rec is not None:
            slots = self._fwd.slots if self._fwd is not None else self._slots(router, routing_map)
            rec.add_routing(self.layer, slots, B)

    def _virtual_tokens(self, router, hidden, routing_map, fc1, token, layout, count) -> _Forward:
        """One virtual token per (token, chosen expert) with its guidance rows (see the module docstring)."""
        batch, full_s, seq = layout
        n_tokens, dev = routing_map.shape[0], routing_map.device
        # (token, expert), token-major; replayed routing with a repeated expert (e.g. at padding) routes
        # fewer than top-k rows for that token, and only nonzero() (one host sync) can size that
        if self.routing_distinct:
            e = _virtual_experts(routing_map, self.topk)
            key = ("virtual", batch, full_s, seq.indices(full_s), self.topk, dev)
            t, bt = self.state.cached(key, lambda: _with_rows(_virtual_token_ids(n_tokens, self.topk, dev), token))
        else:
            t, e = routing_map.nonzero().unbind(1)
            bt = token.index_select(0, t)
        n = t.shape[0]  # bt: the batch-major row of each virtual token's token
        gathers = {}
        if self.recorded_fc1:
            gathers[FC1] = _Gather(fc1.record, t, self.state.all_valid_flags(n, dev), all_valid=True)
        elif FC1 in self.codecs:
            gathers[FC1] = None if fc1 is None else self._fc1_gather(fc1, bt)
        if FC2 in self.codecs:
            gathers[FC2] = self._fc2_rows(batch, full_s, t, e, bt, count, dev)
        slots = self._slots(router, routing_map) if self.state.recorder is not None else None
        if self.local_rows:  # gathered here, before the dispatcher's host sync, not in the experts after it
            order, counts = self.moe.experts.local_payload_order(e, self.num_experts)
            rows = {site: self._permuted(site, g, order) for site, g in gathers.items()}
            return _Forward(n_tokens, batch, t, e, None, slots, rows, counts)
        cols = [self._encode(site, g, n, dev) for site, g in gathers.items()]
        if self.per_tensor_fc1:
            cols.append(encode_amax(abs_max(hidden).reshape(1, 1).expand(n, 1)))
        width = sum(c.shape[1] for c in cols)
        pad = max(self.back_width - width, 0 if cols else 1)
        if pad:  # the combine path returns rows as wide as the dispatched ones
            cols.append(torch.zeros(n, pad, dtype=torch.uint8, device=dev))
        return _Forward(n_tokens, batch, t, e, torch.cat(cols, dim=1), slots)

    def _full_seq(self, hidden_seq: int) -> int:
        tp = self.moe.attn_tp_group
        sp = self.moe.config.sequence_parallel and tp.size() > 1
        return hidden_seq * tp.size() if sp else hidden_seq

    def _slots(self, router, routing_map) -> torch.Tensor:
        """The expert of each of a token's top-k slots: replayed, recorded by Megatron, or ascending."""
        if self._replay_slots is not None:
            return self._replay_slots
        rr = router.router_replay
        if rr is not None and rr.recorded_topk_idx is not None and self.state.recorder is not None:
            return rr.recorded_topk_idx.long()
        return routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1)

    # ---- guidance rows ------------------------------------------------------------------------
    def _fits(self, c: CheckedSite, batch: int, full_s: int) -> bool:
        r = c.sg.record
        ok = tuple(r.shape[:2]) == (batch, full_s)
        if not ok and self.state.fallback == "fail":
            got = tuple(r.shape[:2])
            raise GuidanceFallbackError(f"layer {self.layer}: guidance rows {got} != [B, S]={(batch, full_s)}")
        return ok

    def _fc1_rows(self, seq, batch, full_s, count, token, device) -> RowGuidance | None:
        """FC1 guidance rows, batch-major [B * full_s] (``token`` picks the local tokens), counted per token."""
        if not self.state.config.quantizes(FC1) or FC1 not in self.state.config.guided_sites:
            return None
        n = counted_total(count, token.numel())
        if not self.guide_fc1:
            self.state.count(self.layer, FC1, 0, {NOT_GUIDED: n})
            return None
        c = self.fc1
        if c.sg is None or not self._fits(c, batch, full_s):
            self.state.count(self.layer, FC1, 0, {c.reason or SHAPE: n})
            self.fc1 = CheckedSite(None, c.reason or SHAPE)  # the experts then round on their own (all_valid off)
            return None
        rec = _on(c.sg.record, device)
        if c.all_valid:
            self.state.count(self.layer, FC1, n, {INVALID: 0})
            return RowGuidance(flat_record(rec, 2), self.state.all_valid_flags(c.sg.valid.numel(), device))
        valid = c.sg.valid.to(device)
        used = counted_valid(valid, count, token)
        self.state.count(self.layer, FC1, used, {INVALID: n - used})
        return flat_rows(rec, valid)

    def _fc1_gather(self, fc1: RowGuidance, bt: torch.Tensor) -> _Gather:
        if self.fc1.all_valid:
            return _Gather(fc1.record, bt, self.state.all_valid_flags(bt.numel(), bt.device), all_valid=True)
        return _Gather(fc1.record, bt, fc1.valid.index_select(0, bt))

    def _fc2_rows(self, batch, full_s, t, e, bt, count, device) -> _Gather | None:
        """FC2 rows of the virtual tokens (t, e): the rollout slot of token t with expert e, counted per row."""
        cnt = None if count is None else count.index_select(0, t)
        n = counted_total(cnt, t.shape[0])
        c = self.fc2
        if c.sg is None or not self._fits(c, batch, full_s):
            self.state.count(self.layer, FC2, 0, {c.reason or SHAPE: n})
            self.fc2 = CheckedSite(None, c.reason or SHAPE)
            return None
        sg = c.sg
        ids = sg.expert_ids.to(device)  # [B, S, topk]
        match = ids.reshape(-1, ids.shape[2]).index_select(0, bt) == e.unsqueeze(1)  # [Nv, topk]
        row = match.to(torch.int8).argmax(1).add(bt, alpha=ids.shape[2])  # [Nv] into [B * S * topk]
        rec = flat_record(_on(sg.record, device), 3)
        if c.all_valid:  # every record valid and of the replayed experts: no mismatch, no invalid row
            self.state.count(self.layer, FC2, n, {EXPERT_MISMATCH: 0, INVALID: 0})
            return _Gather(rec, row, self.state.all_valid_flags(row.numel(), device), all_valid=True)
        has = match.any(1)
        valid = sg.valid.to(device).reshape(-1).index_select(0, row)
        ok = valid & has
        self.state.count(self.layer, FC2, counted_sum(ok, cnt), {
            EXPERT_MISMATCH: counted_sum(~has, cnt), INVALID: counted_sum(has & ~valid, cnt),
        })
        return _Gather(rec, row, ok)

    def _permuted(self, site: str, gather: _Gather | None, order: torch.Tensor) -> RowGuidance:
        if gather is None:
            return self.codecs[site].decode(self.codecs[site].empty(order.numel(), order.device))
        return gather.rows(order)

    def _encode(self, site: str, gather: _Gather | None, n: int, device) -> torch.Tensor:
        codec = self.codecs[site]
        return codec.empty(n, device) if gather is None else codec.encode(gather.rows())

    # ---- used by the experts ------------------------------------------------------------------
    def expert_rows(self, experts, tokens_per_expert) -> ExpertRows:
        """Dispatch the virtual tokens like the real ones and decode the rows for ``experts``."""
        if not self.needs_dispatch:
            return ExpertRows()
        f = self._fwd
        if f is None:
            raise RuntimeError(f"layer {self.layer}: the experts ran before the router hook (TRACE context not bound)")
        if f.gathers is not None:
            counts = f.counts
        else:
            probs_dtype = torch.float32 if self.recording_fc2 else torch.uint8
            data, counts = experts.dispatch_payload(f.payload, f.expert, self.num_experts, probs_dtype)
        tpe = to_device_async(torch.as_tensor(tokens_per_expert), counts.device)  # Megatron's are on the host
        if tpe.shape != counts.shape:
            raise RuntimeError(f"layer {self.layer}: {counts.numel()} guidance row counts for {tpe.numel()} experts")
        self.state.defer_check((counts != tpe).any(), f"layer {self.layer}: guidance rows per expert did not match "
                               "the token rows (the guidance of this step was misaligned)")
        out, col = ExpertRows(), 0
        for site, codec in self.codecs.items():
            if f.gathers is None:
                rows = codec.decode(data[:, col : col + codec.width])
                col += codec.width
            else:
                rows = f.gathers[site]
            checked = self.fc1 if site == FC1 else self.fc2
            all_valid = checked.all_valid if self._own_rows(experts) else self.received_all_valid.get(site, False)
            all_valid = all_valid or (site == FC1 and self.recorded_fc1)  # (every rank sends its recorded rows)
            setattr(out, "fc1" if site == FC1 else "fc2", dataclasses.replace(rows, all_valid=all_valid))
        if self.per_tensor_fc1:
            out.fc1_amax = decode_amax(data[:, col : col + 4])
        return out

    @staticmethod
    def _own_rows(experts) -> bool:
        """The experts compute this rank's rows only (no tensor/expert parallelism): its own flags hold for them."""
        return experts._trace_pg.tp_ep.size() == 1

    def _record_fc1(self, x, fc1: RowGuidance | None, batch: int) -> FP4Tensor:
        """Quantize (guided where ``fc1`` is valid) and record the FC1 rows ``x`` [T, H] in token order."""
        q = self.state.config.activation_quantizer()
        amax = None
        if self.per_tensor_fc1:
            amax = abs_max(x).reshape(1, 1).expand(x.shape[0], 1)
        _, rec = quantize_rows_recorded(q, x, fc1, global_amax=amax)
        self.state.recorder.add_rows(self.layer, FC1, rec, batch)
        return rec

    def record_fc2(self, experts, q2) -> None:
        """Send the FC2 rows an experts module quantized back to their tokens' slots and record them."""
        f, codec = self._fwd, self.back_codec
        ones = torch.ones(q2.shape[0], dtype=torch.bool, device=q2.codes.device)
        data = codec.encode(RowGuidance(q2.guidance(compact=False), ones)).float()
        data = torch.nn.functional.pad(data, (0, f.payload.shape[1] - codec.width))
        back = experts.combine_payload(data)  # [Nv, C] in virtual-token order
        got = codec.decode(back[:, : codec.width].round().to(torch.uint8))
        t, e = f.token, f.expert
        slot = (f.slots.index_select(0, t) == e.unsqueeze(1)).to(torch.int8).argmax(1)
        self.state.recorder.add_fc2(self.layer, got, t * self.topk + slot, f.tokens, self.topk, f.slots, f.batch)


def _on(record: Record, device) -> Record:
    """``record`` with every tensor on ``device`` (no copy where it is there)."""
    return map_record(record, lambda t: t.to(device), tuple(record.shape))


def _with_rows(t: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t, token.index_select(0, t)
