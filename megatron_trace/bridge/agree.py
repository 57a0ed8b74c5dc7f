"""Ranks agree on an outcome before the next collective, so that a failure on one rank raises on every rank
instead of leaving the others waiting in a gather or scatter (the bridge's loads and saves)."""

from __future__ import annotations

import torch.distributed as dist


def agreed(check, what: str, error_type: type[Exception] = ValueError):
    """Run ``check()`` on every rank, then ``agree`` on its outcome; returns what ``check()`` returned."""
    error = result = None
    try:
        result = check()
    except Exception as e:  # re-raised by agree, once every rank knows
        error = e
    agree(error, what, error_type)
    return result


def agree(error: Exception | None, what: str, error_type: type[Exception] = ValueError) -> None:
    """Every rank learns every rank's outcome (one ``all_gather_object`` over the world) before the next collective:
    a rank that failed re-raises its error, the others raise ``error_type`` "rank R {what} (...): its reason"."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        reasons = [None] * world
        try:
            dist.all_gather_object(reasons, None if error is None else f"{type(error).__name__}: {error}")
        except Exception as e:
            if error is None:
                raise
            error.add_note(f"(the other ranks could not be told: {type(e).__name__}: {e})")
            raise error from None
        failed = [(r, why) for r, why in enumerate(reasons) if why is not None]
        if failed and error is None:
            r, why = failed[0]
            raise error_type(f"rank {r} {what} (this rank's part succeeded; {len(failed)} of {world} rank(s) "
                             f"failed): {why}")
        if error is not None:
            error.add_note(f"(on rank {dist.get_rank()} of {world}; the other ranks raise naming it)")
    if error is not None:
        raise error
