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

from ..formats import FP4Tensor
from .base import RolloutBatch, SamplingParams, WeightValue
from .experts import FC1, FC2
from .hf_weights import checkpoint_tensors, join_fc1, parse_expert_name

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
    """Names of ``weights`` the model does not hold: a dense weight whose tensor (under its name, or a routed
    expert's slice of transformers' fused expert parameters) has other values in the model's dtype; an expert the
    backend holds in FP4 (``weight_store``) whose stored codes / scales / amax are not the quantized update (a BF16
    value, quantized as the backend does: gate and up as one matrix) or the FP4 update itself."""
    held = dict(checkpoint_tensors(backend.model))
    store = getattr(backend, "weight_store", None)
    fp4_layer = lambda layer: store is not None and layer not in getattr(backend, "bf16_expert_layers", ())  # noqa: E731
    out, experts = [], {}
    for n, v in weights:
        parsed = parse_expert_name(n)
        if parsed is not None and fp4_layer(parsed[0]):
            experts.setdefault(parsed[:2], {})[parsed[2]] = (n, v)
        elif isinstance(v, torch.Tensor) and n in held and not torch.equal(held[n], v.to(held[n].device,
                                                                                         held[n].dtype)):
            out.append(n)
    for (layer, e), parts in experts.items():
        for which, projs in ((FC1, ("gate_proj", "up_proj")), (FC2, ("down_proj",))):
            if all(p in parts for p in projs):
                names, values = zip(*(parts[p] for p in projs))
                if not _stored_as(store, layer, e, which, values, held[names[0]]):
                    out.extend(names)
    return out


def _stored_as(store, layer: int, e: int, which: str, values, param: torch.Tensor) -> bool:
    """Whether ``store`` holds expert ``e``'s ``which`` matrix as the update ``values`` (gate, up or down)."""
    if all(isinstance(v, FP4Tensor) for v in values):
        want = join_fc1(*values) if which == FC1 else values[0]
    else:
        want = store.quantizer.quantize(torch.cat([v.to(param.device, param.dtype) for v in values]))
    try:
        got = store.get(layer, e, which)
    except KeyError:
        return False
    on = lambda t: None if t is None else t.to(got.codes.device)  # noqa: E731
    return (torch.equal(got.codes, on(want.codes))
            and torch.equal(got.block_scales.view(torch.uint8), on(want.block_scales.view(torch.uint8)))
            and _same_or_both_none(got.global_amax, on(want.global_amax)))


def refit_self_test(make_backend: Callable[[], object], weights_a: Weights, weights_b: Weights,
                    prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, fresh_a=None) -> dict[str, float]:
    """A -> B -> A on one backend vs A on a fresh one; raises ``RefitError`` on any difference.

    ``make_backend()`` builds a backend (same config every call); ``weights_*`` are complete HF-named
    weight lists; ``fresh_a``: a backend started from checkpoint A (its startup path; default:
    ``make_backend()`` then one update to A, which shares the update path under test);
    ``sampling`` should carry a seed. Returns ``{"refit/...": 1.0}`` when all checks pass. Either way the dense
    tensors of A (every one the model holds, routed experts included) must be the model's after the last update to A: a
    backend that drops part of every update would otherwise match a reference built through the same update.
    """
    weights_a, weights_b = list(weights_a), list(weights_b)  # (generators: read once, used up to three times)
    if not weights_a or not weights_b:
        raise ValueError(f"refit_self_test needs two complete weight lists, got {len(weights_a)} and "
                         f"{len(weights_b)} tensors")
    fresh = fresh_a
    if fresh is None:
        fresh = make_backend()
        fresh.update_weights(weights_a)
    want = fresh.generate(prompts, sampling)
    be = make_backend()
    ptrs = param_addresses(be)
    be.update_weights(weights_a)  # versions: +1 per update
    be.generate(prompts, sampling)  # exercise whatever a generate call may cache
    be.update_weights(weights_b)
    on_b = be.generate(prompts, sampling)
    be.update_weights(weights_a)
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
