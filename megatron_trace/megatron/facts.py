"""What a guided step finds out about its routing and records once, with one host sync, before the forward runs
(``step_facts``: called by ``trace_guidance`` over every layer's step of every micro-batch)."""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.checks import host_values
from .moe_step import FC1, MoEStep


def step_facts(steps) -> None:
    """What the forward would otherwise ask the device for, layer by layer, found with one host sync: each
    layer's routing indices are in range (else ValueError) and distinct per token (then the guidance rows
    are laid out without ``nonzero``), and which sites' records are valid on every row (then the quantizer
    needs no per-row select; at FC2 the records' experts must also be the replayed ones).

    Where a layer repeats an expert only at padding positions (``StepGuidance.token_mask`` False; the rollouts
    fill padding with expert 0), those positions are replayed as experts 0..k-1: distinct, so no ``nonzero``
    either. Padding tokens feed no real token and no loss term, so real tokens' numbers do not change.

    Under tensor/expert parallelism the experts also compute other ranks' rows: whether those are all valid is
    agreed with one all-reduce over the group (``_agree_received``), a second read."""
    groups = _routing_groups([st for st in steps if isinstance(st, MoEStep) and st.routing is not None])
    ranges = [v for _, r in groups for v in torch.aminmax(r)]  # min, max of each group's indices
    replayed = [st for group, _ in groups for st in group]
    facts = _valid_facts(steps)
    checks = []  # (step, padding mask or None, bool tensor): distinct everywhere, then on real tokens only
    for group, r in groups:
        srt = r.sort(dim=-1).values
        checks += [(st, None, d) for st, d in zip(group, _distinct(srt).unbind(0))]
        pad = _padding(group[0].state.token_mask, r)
        if pad is not None:
            checks += [(st, pad, d) for st, d in zip(group, _distinct(srt, pad).unbind(0))]
    values = host_values(ranges + [d for *_, d in checks] + [ok for *_, ok in facts])
    if any(lo < 0 or hi >= min(st.num_experts for st in group)
           for (group, _), lo, hi in zip(groups, values[0 : len(ranges) : 2], values[1 : len(ranges) : 2])):
        _raise_out_of_range(replayed)
    bits = [bool(v) for v in values[len(ranges) :]]
    for (st, pad, _), v in zip(checks, bits):
        if v and not st.routing_distinct:
            if pad is not None:
                st.routing = _distinct_padding(st.routing, pad)
            st.routing_distinct = True
    for (owner, name, c, _), v in zip(facts, bits[len(checks) :]):
        if v:
            if isinstance(owner, MoEStep):
                setattr(owner, name, dataclasses.replace(c, all_valid=True))
            else:
                owner.sites[name] = dataclasses.replace(c, all_valid=True)
    _agree_received([st for st in steps if isinstance(st, MoEStep)])


def _agree_received(steps: list[MoEStep]) -> None:
    """``MoEStep.received_all_valid`` of the layers whose experts compute other ranks' rows (tensor/expert
    parallel group > 1): their guidance rows are all valid only where every rank's are, and fit its batch (the
    routing replayed: its [B, S] is the batch's); one all-reduce (MIN) per group over every layer's flags."""
    groups: dict[int, tuple] = {}
    for st in steps:
        group = st.moe.experts._trace_pg.tp_ep
        if st.codecs and group.size() > 1:
            groups.setdefault(id(group), (group, []))[1].append(st)
    for group, members in groups.values():
        sites = [(st, site) for st in members for site in st.codecs]
        flags = torch.tensor([_sends_all_valid(st, site) for st, site in sites], dtype=torch.int32,
                             device=next(members[0].moe.parameters()).device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=group)
        for (st, site), v in zip(sites, flags.tolist()):
            st.received_all_valid[site] = bool(v)


def _sends_all_valid(st: MoEStep, site: str) -> bool:
    """This rank's guidance rows of ``site`` will all be valid when dispatched (``MoEStep._fits`` at the forward)."""
    c = st.fc1 if site == FC1 else st.fc2
    return c.all_valid and st.routing is not None and tuple(c.sg.record.shape[:2]) == tuple(st.routing.shape[:2])


def _padding(token_mask: torch.Tensor | None, routing: torch.Tensor) -> torch.Tensor | None:
    """bool [B, S]: the padding positions of routing [L, B, S, topk] (None without a fitting token mask)."""
    if token_mask is None or tuple(token_mask.shape) != tuple(routing.shape[1:3]):
        return None
    return ~token_mask.to(routing.device)


def _distinct_padding(routing: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """routing [B, S, topk] with its padding positions replayed as experts 0..topk-1."""
    k = routing.shape[-1]
    return torch.where(padding[..., None], torch.arange(k, device=routing.device, dtype=routing.dtype), routing)


def _routing_groups(steps) -> list[tuple[list, torch.Tensor]]:
    """The layers' routing indices stacked by shape, device and micro-batch token mask: (layers, int64
    [L, B, S, topk])."""
    by_kind: dict = {}
    for st in steps:
        by_kind.setdefault((tuple(st.routing.shape), st.routing.device, id(st.state.token_mask)), []).append(st)
    return [(group, torch.stack([st.routing for st in group])) for group in by_kind.values()]


def _distinct(srt: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
    """bool [L]: the top-k experts of every token are distinct, per layer of sorted routing [L, B, S, topk]
    (``padding`` [B, S]: positions left out)."""
    ok = srt[..., 1:] != srt[..., :-1]
    if padding is not None:
        ok = ok | padding[None, :, :, None]
    return ok.flatten(1).all(1)


def _raise_out_of_range(steps) -> None:
    """The per-layer check behind a step's out-of-range routing indices (a second sync, on the error path)."""
    bad = host_values([((st.routing < 0) | (st.routing >= st.num_experts)).any() for st in steps])
    msgs = [f"routing indices for layer {st.layer} must be in 0..{st.num_experts - 1}"
            for st, b in zip(steps, bad) if b]
    if msgs:
        raise ValueError("; ".join(msgs))


def _valid_facts(steps) -> list:
    """(owner, site name, CheckedSite, bool device tensor): the site's records are valid on every row (at FC2
    also of the replayed experts)."""
    sites = []
    for st in steps:
        if isinstance(st, MoEStep):
            sites.extend((st, name, getattr(st, name), st.routing) for name in ("fc1", "fc2"))
        else:
            sites.extend((st, site, c, None) for site, c in st.sites.items())
    facts = []
    for owner, name, c, routing in sites:
        if c.sg is None:
            continue
        ok = c.sg.valid
        if name == "fc2":
            ids = c.sg.expert_ids
            if routing is None or ids is None or tuple(ids.shape) != tuple(routing.shape):
                continue
            ok = ok.to(routing.device) & (ids.to(routing.device) == routing)
        facts.append((owner, name, c, ok.all()))
    return facts
