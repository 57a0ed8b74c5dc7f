"""Fake-quantized expert weights computed once for several micro-batches (``train_step.reuse_weight_quant``).

Inside the scope the first forward of an experts module fake-quantizes its stacked weights as usual and keeps
the value; later forwards return that value through ``expert_weights.with_stack_gradient``, whose backward is the
straight-through gradient of the fake-quantizer (``TraceConfig.ste_clip=False``): the same gradients, bit for bit,
without the stack, amax and quantize passes. The scope's contract: no optimizer step inside it. Each reuse checks
that every weight still has the storage and version counter it had: an in-place update through the parameter
raises, but a write through ``.data`` or a shared buffer (what Megatron's optimizers do: the fp16 main-param
copy-back, the distributed optimizer's parameter buffer) changes neither and is NOT detected. Megatron-LM's
``train_step`` (``trace_train_step``) closes the scope before ``optimizer.step()``.
"""

from __future__ import annotations

from operator import attrgetter

import torch

from .expert_weights import with_stack_gradient

_ADDRESS, _VERSION = torch.Tensor.data_ptr, attrgetter("_version")


def weights_key(weights) -> tuple:
    """Storage addresses and version counters of ``weights``: changes with a re-seat or an in-place update
    (one ``map`` each: half the host time of a generator over 128 weights)."""
    return tuple(map(_ADDRESS, weights)), tuple(map(_VERSION, weights))


def reuse_or_make(cache: dict, name: str, weights: list[torch.Tensor], make) -> torch.Tensor:
    """``make()`` on the first call for ``name`` in the scope (kept in ``cache``), the kept value after."""
    hit = cache.get(name)
    if hit is None:
        out = make()
        cache[name] = (weights_key(weights), out.detach())
        return out
    if hit[0] != weights_key(weights):
        raise RuntimeError(f"expert weights {name!r} changed inside reuse_weight_quant (an in-place update inside "
                           "the scope): leave the scope before any weight update (optimizer.step() included)")
    return with_stack_gradient(hit[1], weights)
