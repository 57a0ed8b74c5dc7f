"""Packed sequences (THD): a batch-major ``StepGuidance`` laid out for a packed micro-batch.

Megatron RL trainers (slime, verl's Megatron backend) concatenate a micro-batch's samples into one row (tokens
[1, T], hidden states [T, 1, H]) and give the sample boundaries to Transformer Engine's attention in
``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, cu_seqlens_q/kv_padded)``. TRACE's guidance contract is
batch-major [B, S, ...] (``guidance/site.py``); ``pack_step`` moves it to [1, T]::

    packed = pack_step(step, packed_seq_params, total=tokens.shape[1])
    with trace_guidance(model, packed) as h:
        model(tokens, position_ids, None, packed_seq_params=packed_seq_params)

``cu_seqlens`` are the boundaries of the samples' segments in the packed row (int [B + 1], from 0,
non-decreasing; from a ``PackedSeqParams``: its ``cu_seqlens_q_padded`` where set, else ``cu_seqlens_q``, as
Megatron's attention takes them): sample b's tokens (its ``token_mask`` row, in order: left- or right-padded rows
alike; every position of the row without a mask) go to positions ``cu_seqlens[b], cu_seqlens[b] + 1, ...``.
Positions of a segment beyond its sample's tokens (a sample padded to a multiple, ``cu_seqlens_padded``) and
positions from ``cu_seqlens[-1]`` to ``total`` (the row's tail padding) are not counted: ``token_mask`` False,
records zero and invalid, routing expert 0 (as ``guidance.routing.assemble_routing`` fills padding). Unpadded
``cu_seqlens_q`` given for a row laid out by padded segments would misplace every sample after the first padded
one, which nothing here can tell: give the boundaries the row was built with (the ``PackedSeqParams`` itself).
A ``PackedSeqParams`` whose ``cu_seqlens_q`` differs from its ``cu_seqlens_q_padded`` gives the samples' lengths too
(Transformer Engine attends to that many tokens of each segment): each ``token_mask`` row must hold exactly its
sample's length, else refused (a token of the row beyond the mask's would take no guidance and not be counted).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..guidance.layout import PackedLayout
from ..guidance.site import SiteGuidance
from .context import StepGuidance
from .rows import map_record

logger = logging.getLogger(__name__)


def pack_step(step: StepGuidance, cu_seqlens, *, total: int | None = None) -> StepGuidance:
    """``step`` (batch-major [B, S, ...]) in the packed layout [1, T] of ``cu_seqlens`` (int [B + 1], or the
    forward's ``PackedSeqParams``: see the module docstring); ``total``: the packed row's length T when it ends in
    tail padding (default ``cu_seqlens[-1]``). Sites, routing, token mask are moved; counter (the same object),
    fallback and min_coverage are carried over. A site whose record is not [B, S] is kept as it is (the packed
    forward rejects it as a whole, counted ``shape``). To assemble guidance straight into the packed layout
    (without the [B, S] copy), give ``packed_layout(...)`` to the assembly as ``layout=``."""
    if not isinstance(step, StepGuidance):
        raise TypeError(f"pack_step takes a StepGuidance, got {type(step).__name__}")
    B, S = _batch_shape(step)
    layout = packed_layout(cu_seqlens, total=total)
    mask = step.token_mask
    if mask is None:
        mask = torch.ones(B, S, dtype=torch.bool)
    src, dst = layout.positions(mask)
    total = layout.total

    def move(t: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> [1, total, ...]: the counted tokens' rows to their packed positions, zeros elsewhere."""
        flat = t.reshape(B * S, *t.shape[2:])
        raw = flat.view(torch.uint8) if flat.element_size() == 1 and flat.dtype != torch.bool else flat  # (fp8)
        out = raw.new_zeros((total, *raw.shape[1:]))
        out[dst.to(raw.device)] = raw[src.to(raw.device)]
        return out.view(flat.dtype).unsqueeze(0)

    sites = {}
    for key, sg in step.sites.items():
        if sg is None or tuple(sg.record.shape[:2]) != (B, S):
            if sg is not None:
                logger.warning("pack_step: guidance %s has rows %s, the micro-batch [B, S]=%s: left unpacked (the "
                               "packed forward rejects it)", key, tuple(sg.record.shape[:2]), (B, S))
            sites[key] = sg
            continue
        record = map_record(sg.record, move, (1, total, *sg.record.shape[2:]))
        sites[key] = SiteGuidance(record, move(sg.valid), None if sg.expert_ids is None else move(sg.expert_ids),
                                  scales_checked=sg.scales_checked)
    routing = {}
    for layer, r in step.routing.items():
        if tuple(r.shape[:2]) != (B, S):
            raise ValueError(f"routing[{layer}] has shape {tuple(r.shape)}; the micro-batch is [B, S]={(B, S)}")
        routing[layer] = move(r)
    packed_mask = torch.zeros(1, total, dtype=torch.bool, device=mask.device)
    packed_mask[0, dst] = True
    return dataclasses.replace(step, sites=sites, routing=routing, token_mask=packed_mask)


def _batch_shape(step: StepGuidance) -> tuple[int, int]:
    """[B, S] of the micro-batch: its token mask's, else its first site's or routing's."""
    if step.token_mask is not None:
        if step.token_mask.dim() != 2:
            raise ValueError(f"token_mask has shape {tuple(step.token_mask.shape)}: pack_step needs bool [B, S]")
        return tuple(step.token_mask.shape)
    shapes = [sg.record.shape[:2] for sg in step.sites.values() if sg is not None]
    shapes += [r.shape[:2] for r in step.routing.values()]
    if not shapes:
        raise ValueError("pack_step needs the micro-batch's [B, S]: give the StepGuidance a token_mask (or records "
                         "or routing)")
    return tuple(shapes[0])


def packed_layout(cu_seqlens, *, total: int | None = None) -> PackedLayout:
    """The ``guidance.layout.PackedLayout`` of a packed row: ``cu_seqlens`` as ``pack_step`` takes it (int [B + 1],
    or the forward's ``PackedSeqParams``: its ``cu_seqlens_q_padded`` where set, else ``cu_seqlens_q``; where both
    are set and differ, ``cu_seqlens_q`` gives the samples' lengths, which the token mask must match); ``total``: the
    row's length (default ``cu_seqlens[-1]``). Give it to ``GuidanceCache.assemble`` / ``records.assemble`` /
    ``GuidanceShard.assemble`` (and their routing twins) as ``layout=`` to assemble straight into [1, T, ...]."""
    lengths = None
    if isinstance(cu_seqlens, PackedSeqParams):
        if cu_seqlens.qkv_format != "thd":
            raise ValueError(f"PackedSeqParams.qkv_format={cu_seqlens.qkv_format!r}: pack_step lays guidance out "
                             "for packed rows, qkv_format='thd'")
        padded, real = cu_seqlens.cu_seqlens_q_padded, cu_seqlens.cu_seqlens_q
        if padded is not None and real is not None:
            real = PackedLayout.of(real).cu_seqlens
            lay = PackedLayout.of(padded, total=total)
            if real != lay.cu_seqlens:
                lengths = [b - a for a, b in zip(real, real[1:])]
                if len(lengths) != lay.batch:
                    raise ValueError(f"PackedSeqParams: cu_seqlens_q has {len(real)} entries, cu_seqlens_q_padded "
                                     f"{len(lay.cu_seqlens)}")
            return PackedLayout.of(lay.cu_seqlens, total=total, lengths=lengths)
        cu_seqlens = padded if padded is not None else real
    return PackedLayout.of(cu_seqlens, total=total)
