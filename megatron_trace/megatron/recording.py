"""Record what the TRACE modules did in one forward, as batch-major guidance (the rollout's contract).

The plugin records the codes it actually used (own rounding, or guided where guided), so a
recording serves as guidance for another run (tests, rollout-side parity checks) and as the
trainer's codes for mismatch metrics. Recording assumes tensor parallel size 1 (every rank holds
whole sequences); expert parallelism is fine (FC2 rows travel back to their tokens' ranks).
"""

from __future__ import annotations

import logging

import torch

from ..formats import FP4Tensor
from ..guidance.site import SiteGuidance
from .rows import RowGuidance, batch_major, map_record
from .step import as_mode

logger = logging.getLogger(__name__)


class Recorder:
    """Collects per-layer records during a ``trace_guidance(..., record=True)`` context."""

    def __init__(self, compact: bool):
        if not isinstance(compact, bool):  # ("no" is truthy: compact records were recorded)
            raise ValueError(f"Recorder: compact={compact!r} must be a bool")
        self.compact = compact
        self.sites: dict[tuple[int, str], SiteGuidance] = {}
        self.routing: dict[int, torch.Tensor] = {}

    def _put(self, key, value: SiteGuidance) -> None:
        if key in self.sites:
            logger.debug("recording %s again (recompute or a second forward): keeping the last", key)
        self.sites[key] = value

    def add_routing(self, layer: int, slots: torch.Tensor, batch: int) -> None:
        """slots int64 [T, topk] in token order."""
        self.routing[layer] = batch_major(slots.long(), batch)

    def add_rows(self, layer: int, site: str, q: FP4Tensor, batch: int) -> None:
        """Token rows q [T, K] (FC1) in Megatron token order."""
        rec = q.guidance(self.compact)
        t = q.shape[0]
        rec = map_record(rec, lambda x: batch_major(x, batch), (batch, t // batch, q.shape[-1]))
        valid = torch.ones(batch, t // batch, dtype=torch.bool, device=q.codes.device)
        self._put((layer, site), SiteGuidance(rec, valid))

    def add_kv(self, layer: int, site: str, q: FP4Tensor) -> None:
        """K or V rows q [S, B, kv_heads, head_dim] -> [B, S, kv_heads, head_dim]."""
        s, b = q.shape[0], q.shape[1]
        rec = map_record(q.guidance(self.compact), lambda x: x.transpose(0, 1).contiguous(), (b, s, *q.shape[2:]))
        self._put((layer, site), SiteGuidance(rec, torch.ones(b, s, dtype=torch.bool, device=q.codes.device)))

    def add_fc2(self, layer: int, rows: RowGuidance, flat_index: torch.Tensor, tokens: int, topk: int,
                slots: torch.Tensor, batch: int) -> None:
        """FC2 rows [Nv, F] (full records) placed at slot rows ``flat_index`` (= token * topk + slot)."""
        n = tokens * topk
        rec = rows.record

        def place(x):
            out = x.new_zeros((n, *x.shape[1:]))
            return out.index_copy(0, flat_index, x)

        scales = place(rec.block_scales.view(torch.uint8)).view(rec.block_scales.dtype)
        amax = None if rec.global_amax is None else place(rec.global_amax)
        full = type(rec)(codes=place(rec.codes), block_scales=scales, global_amax=amax, shape=(n, rec.shape[-1]),
                         fmt=rec.fmt)
        valid = torch.zeros(n, dtype=torch.bool, device=flat_index.device).index_fill(0, flat_index, True)
        seq = tokens // batch
        to_bm = lambda x: batch_major(x.reshape(tokens, topk, *x.shape[1:]), batch)  # noqa: E731
        out = map_record(as_mode(full, self.compact), to_bm, (batch, seq, topk, rec.shape[-1]))
        self._put((layer, "expert_fc2_in"), SiteGuidance(out, to_bm(valid), batch_major(slots.long(), batch)))
