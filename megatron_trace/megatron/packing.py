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

from ..guidance.site import SiteGuidance, is_integer
from .context import StepGuidance
from .rows import map_record

logger = logging.getLogger(__name__)


def pack_step(step: StepGuidance, cu_seqlens, *, total: int | None = None) -> StepGuidance:
    """``step`` (batch-major [B, S, ...]) in the packed layout [1, T] of ``cu_seqlens`` (int [B + 1], or the
    forward's ``PackedSeqParams``: see the module docstring); ``total``: the packed row's length T when it ends in
    tail padding (default ``cu_seqlens[-1]``). Sites, routing, token mask are moved; counter (the same object),
    fallback and min_coverage are carried over. A site whose record is not [B, S] is kept as it is (the packed
    forward rejects it as a whole, counted ``shape``)."""
    if not isinstance(step, StepGuidance):
        raise TypeError(f"pack_step takes a StepGuidance, got {type(step).__name__}")
    B, S = _batch_shape(step)
    cu, actual = _boundaries(cu_seqlens, B)
    if total is None:
        total = cu[-1]
    elif not is_integer(total) or int(total) < cu[-1]:
        raise ValueError(f"total={total!r} must be an int >= cu_seqlens[-1]={cu[-1]} (the packed row's length)")
    total = int(total)
    mask = step.token_mask
    if mask is None:
        mask = torch.ones(B, S, dtype=torch.bool)
    lengths = mask.sum(1).tolist()  # (one host read)
    if actual is not None and lengths != actual:
        b = next(i for i, (n, a) in enumerate(zip(lengths, actual)) if n != a)
        raise ValueError(f"sample {b} has {lengths[b]} tokens in its token_mask row, but the PackedSeqParams holds "
                         f"{actual[b]} (cu_seqlens_q, the samples' lengths: {actual}); the token_mask must mark "
                         "exactly the tokens the packed row holds (the rest would be unguided and not counted)")
    segments = [b - a for a, b in zip(cu, cu[1:])]
    long = [(b, n, seg) for b, (n, seg) in enumerate(zip(lengths, segments)) if n > seg]
    if long:
        b, n, seg = long[0]
        raise ValueError(f"sample {b} has {n} tokens, longer than its segment cu_seqlens[{b}:{b + 2}]={cu[b:b + 2]} "
                         f"({seg} positions); cu_seqlens must give each sample at least its token_mask row's tokens")
    src, dst = _token_rows(mask, cu)

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
    packed_mask[0, dst.to(mask.device)] = True
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


def _boundaries(cu_seqlens, batch: int) -> tuple[list[int], list[int] | None]:
    """(``cu_seqlens`` (or a ``PackedSeqParams``'s) as B + 1 ints from 0, non-decreasing (one host read of a
    tensor); the samples' lengths where they are known apart from the segments: a ``PackedSeqParams`` whose
    ``cu_seqlens_q`` differs from its ``cu_seqlens_q_padded`` (Transformer Engine then attends to the first
    ``cu_seqlens_q`` lengths of each padded segment), else None)."""
    if isinstance(cu_seqlens, PackedSeqParams):
        if cu_seqlens.qkv_format != "thd":
            raise ValueError(f"PackedSeqParams.qkv_format={cu_seqlens.qkv_format!r}: pack_step lays guidance out "
                             "for packed rows, qkv_format='thd'")
        padded, real = cu_seqlens.cu_seqlens_q_padded, cu_seqlens.cu_seqlens_q
        if padded is not None and real is not None:
            real = _boundaries(real, batch)[0]
            cu = _boundaries(padded, batch)[0]
            return cu, None if real == cu else [b - a for a, b in zip(real, real[1:])]
        cu_seqlens = padded if padded is not None else real
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be integer (int32 as PackedSeqParams holds it), got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [B + 1], got shape {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)):
        bad = [v for v in cu_seqlens if not is_integer(v)]
        if bad:  # (1.5 would place a sample between positions; [[0, 3]] is no 1-D list)
            raise ValueError(f"cu_seqlens must be 1-D integers, got {bad[0]!r} in {list(cu_seqlens)}")
        cu = [int(v) for v in cu_seqlens]
    else:
        raise ValueError(f"cu_seqlens must be an integer tensor or a list of ints [B + 1] (or a PackedSeqParams), "
                         f"got {type(cu_seqlens).__name__}")
    if len(cu) != batch + 1:
        raise ValueError(f"cu_seqlens has {len(cu)} entries, the micro-batch has B={batch} samples: need B + 1 = "
                         f"{batch + 1} (a trailing padding segment is given as total=, not as a sample)")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]} (in {cu})")
    down = [i for i in range(batch) if cu[i + 1] < cu[i]]
    if down:
        i = down[0]
        raise ValueError(f"cu_seqlens must not decrease: cu_seqlens[{i + 1}]={cu[i + 1]} < cu_seqlens[{i}]={cu[i]} "
                         f"(in {cu})")
    return cu, None


def _token_rows(mask: torch.Tensor, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 (src, dst): each counted token's batch-major row (``b * S + s``) and its packed position."""
    b, s = mask.nonzero().unbind(1)  # row-major: sample by sample, positions in order
    rank = (mask.long().cumsum(1) - 1)[b, s]  # the token's index among its sample's tokens
    start = torch.tensor(cu[:-1], dtype=torch.int64, device=mask.device)
    return b * mask.shape[1] + s, start[b] + rank
