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
computes. Recording FC2 runs the same dispatcher's combine path backwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from .rows import RowCodec, RowGuidance, decode_amax, encode_amax, take, token_major
from .sites import quantize_rows_recorded
from .step import (
    EXPERT_MISMATCH,
    INVALID,
    NOT_GUIDED,
    SHAPE,
    CheckedSite,
    GuidanceFallbackError,
    StepState,
    flat_rows,
    local_seq,
    token_rows,
)

FC1, FC2 = "expert_fc1_in", "expert_fc2_in"


@dataclass
class ExpertRows:
    """Guidance aligned with the permuted rows an experts module computes ([N] rows)."""

    fc1: RowGuidance | None = None
    fc2: RowGuidance | None = None
    fc1_amax: torch.Tensor | None = None  # float32 [N, 1]: the source rank's per-tensor FC1 amax


@dataclass
class _Forward:
    """Per-forward data prepared by the router hook."""

    tokens: int
    batch: int
    virtual: torch.Tensor  # int64 [Nv, 2]: (token, expert), token-major
    payload: torch.Tensor | None  # uint8 [Nv, C]
    slots: torch.Tensor | None  # int64 [T, topk]: expert of each slot (when recording)


def _virtual_pairs(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """``routing_map.nonzero()`` of a dropless routing map (exactly ``topk`` experts per token, which
    ``trace_guidance`` requires where rows are dispatched) without its host sync: [T * topk, 2]."""
    t = routing_map.shape[0]
    experts = routing_map.to(torch.int8).topk(topk, dim=1).indices.sort(dim=1).values  # [T, topk] ascending
    tokens = torch.arange(t, device=routing_map.device).repeat_interleave(topk)
    return torch.stack([tokens, experts.reshape(-1)], dim=1)


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
        self.codecs = {}  # payload columns, identical on every rank (they depend on the config only)
        if self.guide_fc1:
            self.codecs[FC1] = RowCodec(cfg.format, mcfg.hidden_size, state.compact)
        if self.guide_fc2:
            self.codecs[FC2] = RowCodec(cfg.format, mcfg.moe_ffn_hidden_size, state.compact)
        self.needs_dispatch = bool(self.codecs) or self.per_tensor_fc1 or self.recording_fc2
        self.back_codec = RowCodec(cfg.format, mcfg.moe_ffn_hidden_size, compact=False)  # recorded FC2 rows
        self.back_width = self.back_codec.width if self.recording_fc2 else 0
        self.routing_distinct = routing is None  # top-k distinct experts per token (replay: found per step)
        self._fwd: _Forward | None = None
        self._replay_slots = None

    # ---- router hooks --------------------------------------------------------------------------
    def _seq(self, hidden_seq: int, full_seq: int) -> slice:
        tp = self.moe.attn_tp_group
        return local_seq(hidden_seq, full_seq, tp.rank(), self.moe.config.sequence_parallel and tp.size() > 1)

    def router_pre_hook(self, router, args):
        hidden = args[0]
        rr = router.router_replay
        self._replay_slots = None
        if self.routing is not None:
            seq = self._seq(hidden.shape[0], self.routing.shape[1])
            idx = token_major(self.routing.to(hidden.device), seq)  # [T, topk]
            t = hidden.shape[0] * hidden.shape[1]
            if tuple(idx.shape) != (t, self.topk) or self.routing.shape[0] != hidden.shape[1]:
                raise ValueError(
                    f"routing indices for layer {self.layer} have shape {tuple(self.routing.shape)}; "
                    f"the batch needs [B={hidden.shape[1]}, S, topk={self.topk}]"
                )
            # (the index range of every layer was checked once for the step: ``trace_guidance``)
            rr.set_target_indices(idx)
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self._replay_slots = idx
        elif self.state.recorder is not None and rr is not None:
            rr.set_router_replay_action(RouterReplayAction.RECORD)

    def router_hook(self, router, args, output):
        hidden = args[0]  # [S, B, H]
        _, routing_map = output  # [T, E] bool
        S, B = hidden.shape[0], hidden.shape[1]
        full_s = self._full_seq(S)
        seq = self._seq(S, full_s)
        count = self.state.count_mask(seq, S * B, hidden.device)
        x = hidden.reshape(S * B, -1)
        fc1 = self._fc1_rows(seq, B, full_s, count)
        if not self.guide_fc2 and FC2 in self.state.config.guided_sites and self.state.config.quantizes(FC2):
            self.state.count(self.layer, FC2, 0, {NOT_GUIDED: (routing_map & count[:, None]).sum()})
        self._fwd = None
        if self.needs_dispatch:
            self._fwd = self._virtual_tokens(router, x, routing_map, fc1, seq, B, full_s, count)
        rec = self.state.recorder
        if rec is not None:
            slots = self._fwd.slots if self._fwd is not None else self._slots(router, routing_map)
            rec.add_routing(self.layer, slots, B)
            if self.state.config.quantizes(FC1):
                self._record_fc1(x, fc1, B)

    def _virtual_tokens(self, router, x, routing_map, fc1, seq, batch, full_s, count) -> _Forward:
        """One virtual token per (token, chosen expert) with its guidance bytes (see the module docstring)."""
        # [Nv, 2] (token, expert), token-major; replayed routing with a repeated expert (e.g. at padding) routes
        # fewer than top-k rows for that token, and only nonzero() (one host sync) can size that
        virtual = _virtual_pairs(routing_map, self.topk) if self.routing_distinct else routing_map.nonzero()
        n, dev = virtual.shape[0], x.device
        cols = []
        if FC1 in self.codecs:
            cols.append(self._encode(FC1, take(fc1, virtual[:, 0]) if fc1 is not None else None, n, dev))
        if FC2 in self.codecs:
            cols.append(self._encode(FC2, self._fc2_rows(seq, batch, full_s, virtual, count), n, dev))
        if self.per_tensor_fc1:
            cols.append(encode_amax(x.detach().float().abs().amax().reshape(1, 1).expand(n, 1)))
        width = sum(c.shape[1] for c in cols)
        pad = max(self.back_width - width, 0 if cols else 1)
        if pad:  # the combine path returns rows as wide as the dispatched ones
            cols.append(torch.zeros(n, pad, dtype=torch.uint8, device=dev))
        slots = self._slots(router, routing_map) if self.state.recorder is not None else None
        return _Forward(x.shape[0], batch, virtual, torch.cat(cols, dim=1), slots)

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

    def _fc1_rows(self, seq, batch, full_s, count) -> RowGuidance | None:
        if not self.state.config.quantizes(FC1) or FC1 not in self.state.config.guided_sites:
            return None
        n = count.sum()
        if not self.guide_fc1:
            self.state.count(self.layer, FC1, 0, {NOT_GUIDED: n})
            return None
        c = self.fc1
        if c.sg is None or not self._fits(c, batch, full_s):
            self.state.count(self.layer, FC1, 0, {c.reason or SHAPE: n})
            return None
        rec, valid, _ = token_rows(c.sg, seq, count.device)
        used = (valid & count).sum()
        self.state.count(self.layer, FC1, used, {INVALID: n - used})
        return RowGuidance(rec, valid)

    def _fc2_rows(self, seq, batch, full_s, virtual, count) -> RowGuidance | None:
        cnt = count.index_select(0, virtual[:, 0])
        n = cnt.sum()
        c = self.fc2
        if c.sg is None or not self._fits(c, batch, full_s):
            self.state.count(self.layer, FC2, 0, {c.reason or SHAPE: n})
            return None
        rec, valid, ids = token_rows(c.sg, seq, virtual.device)  # [T, topk, F], [T, topk], [T, topk]
        t, e = virtual[:, 0], virtual[:, 1]
        match = ids.index_select(0, t) == e.unsqueeze(1)  # [Nv, topk]
        has = match.any(1)
        slot = match.to(torch.int8).argmax(1)
        row = t * ids.shape[1] + slot
        rows = take(flat_rows(rec, valid), row)
        ok = rows.valid & has
        used = (ok & cnt).sum()
        self.state.count(self.layer, FC2, used, {
            EXPERT_MISMATCH: (~has & cnt).sum(), INVALID: (has & ~rows.valid & cnt).sum(),
        })
        return RowGuidance(rows.record, ok)

    def _encode(self, site: str, rows: RowGuidance | None, n: int, device) -> torch.Tensor:
        codec = self.codecs[site]
        return codec.empty(n, device) if rows is None else codec.encode(rows)

    # ---- used by the experts ------------------------------------------------------------------
    def expert_rows(self, experts, tokens_per_expert) -> ExpertRows:
        """Dispatch the virtual tokens like the real ones and decode the rows for ``experts``."""
        if not self.needs_dispatch:
            return ExpertRows()
        f = self._fwd
        if f is None:
            raise RuntimeError(f"layer {self.layer}: the experts ran before the router hook (TRACE context not bound)")
        probs_dtype = torch.float32 if self.recording_fc2 else torch.uint8
        data, counts = experts.dispatch_payload(f.payload, f.virtual[:, 1], self.num_experts, probs_dtype)
        tpe = torch.as_tensor(tokens_per_expert).to(counts.device, non_blocking=True)
        if tpe.shape != counts.shape:
            raise RuntimeError(f"layer {self.layer}: {counts.numel()} guidance row counts for {tpe.numel()} experts")
        self.state.defer_check((counts != tpe).any(), f"layer {self.layer}: guidance rows per expert did not match "
                               "the token rows (the guidance of this step was misaligned)")
        out, col = ExpertRows(), 0
        for site, codec in self.codecs.items():
            rows = codec.decode(data[:, col : col + codec.width])
            col += codec.width
            checked = self.fc1 if site == FC1 else self.fc2
            setattr(out, "fc1" if site == FC1 else "fc2", dataclasses.replace(rows, all_valid=checked.all_valid))
        if self.per_tensor_fc1:
            out.fc1_amax = decode_amax(data[:, col : col + 4])
        return out

    def _record_fc1(self, x, fc1: RowGuidance | None, batch: int) -> None:
        q = self.state.config.activation_quantizer()
        amax = None
        if self.per_tensor_fc1:
            amax = x.detach().float().abs().amax().reshape(1, 1).expand(x.shape[0], 1)
        _, rec = quantize_rows_recorded(q, x, fc1, global_amax=amax)
        self.state.recorder.add_rows(self.layer, FC1, rec, batch)

    def record_fc2(self, experts, q2) -> None:
        """Send the FC2 rows an experts module quantized back to their tokens' slots and record them."""
        f, codec = self._fwd, self.back_codec
        ones = torch.ones(q2.shape[0], dtype=torch.bool, device=q2.codes.device)
        data = codec.encode(RowGuidance(q2.guidance(compact=False), ones)).float()
        data = torch.nn.functional.pad(data, (0, f.payload.shape[1] - codec.width))
        back = experts.combine_payload(data)  # [Nv, C] in virtual-token order
        got = codec.decode(back[:, : codec.width].round().to(torch.uint8))
        t, e = f.virtual[:, 0], f.virtual[:, 1]
        slot = (f.slots.index_select(0, t) == e.unsqueeze(1)).to(torch.int8).argmax(1)
        self.state.recorder.add_fc2(self.layer, got, t * self.topk + slot, f.tokens, self.topk, f.slots, f.batch)
