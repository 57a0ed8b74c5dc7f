"""NaN/Inf in the rollout's FP4 quantize inputs: one device counter per (layer, site), read once per ``generate``.

FP4 has no NaN/Inf, and an unchecked quantize turns them into finite garbage: the Triton quantizer's block amax
ignores a NaN (the GPU's fp32 max drops it, and so does the interpreter's pair kernel), so a NaN element gets a
finite scale and the code of +-6 (or -0), its dequantized value is finite, the GEMMs downstream see no NaN and the
logits may stay finite; an Inf makes the NVFP4 row's scales NaN (and its other values 0), an MXFP4 block's scale
huge (2**126) and its other values 0. Scales alone therefore cannot tell, and a check in every call (a host read)
would stall every decode step.

``RolloutFiniteChecks`` holds a ``kernels.checks.FiniteCounter`` per ``(layer, site)``, labelled
``"layer <i> <site>"`` as the trainer's (``megatron.check_finite``). The rollout's quantize calls pass it as their
``check_finite``: the Triton kernel counts NaN/Inf inputs into it on the device (no host sync, no extra launch; a
CUDA graph replays the count) and passes them through to the dequantized rows unchanged, the reference quantizer
(CPU, ``kernel="reference"``, stochastic rounding, SGLang's KV format) raises ``NonFiniteError`` in the call as it
always does, re-raised here naming the layer and site (``naming``). ``HFRolloutBackend.generate`` reads every
counter together with its NaN-logit flag in one host read at the end, before anything is assembled, and raises
``NonFiniteError`` naming each offending site with its count: no tokens, log-probs or guidance records of that
batch are returned (a call that raised before that read reads and resets them on its way out). Weights are
checked eagerly where they are quantized (rare: construction, weight sync).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..formats import NonFiniteError
from ..kernels.checks import FiniteCounter, count_tensors, host_values, read_and_reset


class RolloutFiniteChecks:
    """The NaN/Inf counters of one rollout backend's quantize sites (see the module docstring)."""

    def __init__(self):
        self._counters: dict[tuple[int, str], FiniteCounter] = {}

    def counter(self, layer: int, site: str) -> FiniteCounter:
        """The counter of ``(layer, site)`` (made at first use; the same object, and so the same device tensor that
        a captured CUDA graph adds into, afterwards)."""
        key = (int(layer), site)
        c = self._counters.get(key)
        if c is None:  # (no ready points: the producers may run inside a CUDA graph capture)
            c = self._counters[key] = FiniteCounter(f"layer {key[0]} {site}", marks=False)
        return c

    def read(self, *extra: torch.Tensor, outcome: str = "") -> list[int]:
        """Read every counter and ``extra`` (one-element tensors) in one host read per device, reset the counters,
        and raise ``NonFiniteError`` naming each ``(layer, site)`` that counted NaN/Inf since the last read (and
        ``outcome``, what the caller did about it). Returns ``extra``'s values as ints."""
        counters = [c for c in self._counters.values() if c.used]
        values = host_values(count_tensors(counters) + list(extra))
        n = len(counters)
        bad = [(label, k) for label, k in read_and_reset(counters, values[:n]) if k]
        if bad:
            sites = "; ".join(f"{label}: {k}" for label, k in sorted(bad, key=lambda b: _order(b[0])))
            raise NonFiniteError(f"FP4 quantization inputs of the rollout held NaN/Inf since the last check (count "
                                 f"per site, in forward order: {sites}){'; ' + outcome if outcome else ''}. FP4 has "
                                 "no NaN/Inf: fix the producer (a NaN/Inf reaches the sites after the one where it "
                                 "entered)")
        return values[n:]


FORWARD_ORDER = ("kv_k", "kv_v", "expert_fc1_in", "expert_fc2_in")
"""The quantize sites of a decoder layer in the order its forward runs them."""


def _order(label: str) -> tuple[int, int, str]:
    """Sort key of a counter label "layer <i> <site>": layer, then the site's place in the forward."""
    _, layer, site = label.split(" ", 2)
    return int(layer), FORWARD_ORDER.index(site) if site in FORWARD_ORDER else len(FORWARD_ORDER), site


@contextmanager
def naming(counter: FiniteCounter | None) -> Iterator[None]:
    """Re-raise a ``NonFiniteError`` of the reference quantizer (raised in the call) naming ``counter``'s site."""
    try:
        yield
    except NonFiniteError as err:
        if counter is None:
            raise
        raise NonFiniteError(f"rollout FP4 quantize input at {counter.label}: {err}") from err
