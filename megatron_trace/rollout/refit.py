"""Refit self-test of a rollout backend: load weights A, then B, then A again (sglang#39139, verl#7519).

After A -> B -> A the backend must be indistinguishable from a fresh load of A: generation bit-exact
(tokens, log-probs, routing, guidance records), every parameter at its old address (in-place
updates: CUDA graphs and engines keep raw pointers) with the fresh load's values, and no derived
state left stale (the FP4 weight store: packed codes, block scales, amax). ``refit_self_test``
raises ``RefitError`` listing what differs; run it at startup or in CI on the real weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from .base import RolloutBatch, SamplingParams, WeightValue

logger = logging.getLogger(__name__)

Weights = Sequence[tuple[str, WeightValue]]


class RefitError(RuntimeError):
    """A backend is not the same after A -> B -> A as after a fresh load of A."""


def param_addresses(backend) -> dict[str, int]:
    """data_ptr of every parameter and buffer of ``backend.model`` (what in-place updates keep)."""
    return {n: t.data_ptr() for n, t in backend.model.state_dict(keep_vars=True).items()}


def derived_state(backend) -> dict[str, torch.Tensor]:
    """Tensors derived from the weights: the FP4 weight store's codes, scales and amax per matrix."""
    store = getattr(backend, "weight_store", None)
    out = {}
    for (layer, e, which), q in sorted(getattr(store, "_w", {}).items()):
        key = f"weight_store.{layer}.{e}.{which}"
        out[key + ".codes"] = q.codes
        out[key + ".block_scales"] = q.block_scales.view(torch.uint8)
        if q.global_amax is not None:
            out[key + ".global_amax"] = q.global_amax
    return out


def batch_differences(a: RolloutBatch, b: RolloutBatch) -> list[str]:
    """Fields of two rollout batches that are not bit-identical (policy_version not compared)."""
    diffs = [f for f in ("tokens", "prompt_lens", "response_lens", "response_mask", "logprobs")
             if not torch.equal(getattr(a, f), getattr(b, f))]
    if a.routing.keys() != b.routing.keys():
        diffs.append("routing layers")
    diffs += [f"routing[{k}]" for k in a.routing if k in b.routing and not torch.equal(a.routing[k], b.routing[k])]
    if a.guidance.keys() != b.guidance.keys():
        diffs.append("guidance keys")
    for k in a.guidance.keys() & b.guidance.keys():
        ra, rb = a.guidance[k].record, b.guidance[k].record
        pay = "mantissa_bits" if hasattr(ra, "mantissa_bits") else "codes"
        same = (torch.equal(getattr(ra, pay), getattr(rb, pay))
                and torch.equal(a.guidance[k].valid, b.guidance[k].valid)
                and torch.equal(ra.block_scales.view(torch.uint8), rb.block_scales.view(torch.uint8))
                and _same_or_both_none(ra.global_amax, rb.global_amax)
                and _same_or_both_none(a.guidance[k].expert_ids, b.guidance[k].expert_ids))
        if not same:
            diffs.append(f"guidance{k}")
    return diffs


def _same_or_both_none(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    return x is None and y is None or (x is not None and y is not None and torch.equal(x, y))


def _tensor_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> list[str]:
    if a.keys() != b.keys():
        return [f"{what}: keys differ ({sorted(a.keys() ^ b.keys())[:4]})"]
    return [f"{what} {k}" for k in a if not torch.equal(a[k], b[k])]


def not_applied(backend, weights: Weights) -> list[str]:
    """Names of dense ``weights`` the model holds under the same name with other values (in the model's dtype)."""
    sd = backend.model.state_dict()
    return [n for n, v in weights if isinstance(v, torch.Tensor) and n in sd
            and not torch.equal(sd[n], v.to(sd[n].device, sd[n].dtype))]


def refit_self_test(make_backend: Callable[[], object], weights_a: Weights, weights_b: Weights,
                    prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, fresh_a=None) -> dict[str, float]:
    """A -> B -> A on one backend vs A on a fresh one; raises ``RefitError`` on any difference.

    ``make_backend()`` builds a backend (same config every call); ``weights_*`` are complete HF-named
    weight lists; ``fresh_a``: a backend started from checkpoint A (its startup path; default:
    ``make_backend()`` then one update to A, which shares the update path under test);
    ``sampling`` should carry a seed. Returns ``{"refit/...": 1.0}`` when all checks pass. Either way the dense
    tensors of A (those the model holds under their HF names) must be the model's after the last update to A: a
    backend that drops part of every update would otherwise match a reference built through the same update.
    """
    weights_a, weights_b = list(weights_a), list(weights_b)  # (generators: read once, used up to three times)
    if not weights_a or not weights_b:
        raise ValueError(f"refit_self_test needs two complete weight lists, got {len(weights_a)} and "
                         f"{len(weights_b)} tensors")
    fresh = fresh_a
    if fresh is None:
        fresh = make_backend()
        fresh.update_weights(weights_a, version=1)
    want = fresh.generate(prompts, sampling)
    be = make_backend()
    ptrs = param_addresses(be)
    be.update_weights(weights_a, version=1)
    be.generate(prompts, sampling)  # exercise whatever a generate call may cache
    be.update_weights(weights_b, version=2)
    on_b = be.generate(prompts, sampling)
    be.update_weights(weights_a, version=3)
    got = be.generate(prompts, sampling)
    problems = {
        "weights B did not change the outputs (the update does not reach the model)":
            [] if batch_differences(want, on_b) else ["generate"],
        "generate differs": batch_differences(want, got),
        "not in place (data_ptr changed)": [n for n, p in param_addresses(be).items() if ptrs.get(n) != p],
        "parameters differ": _tensor_differences(fresh.model.state_dict(), be.model.state_dict(), "parameter"),
        "update not applied": not_applied(be, weights_a),
        "stale derived state": _tensor_differences(derived_state(fresh), derived_state(be), "derived state"),
    }
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise RefitError("refit A -> B -> A differs from a fresh load of A: " + "; ".join(
            f"{k}: {len(v)}, e.g. {v[:3]}" for k, v in problems.items()))
    logger.info("refit self-test passed: A -> B -> A is bit-exact with a fresh load, %d tensors in place", len(ptrs))
    return {"refit/bit_exact": 1.0, "refit/in_place": 1.0, "refit/derived_state_fresh": 1.0}
