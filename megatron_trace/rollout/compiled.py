"""``HFRolloutBackend(compile=True | "layers")``: ``torch.compile`` of the transformers code around this package's.

Outside its experts and attention, an eager decode step of a transformers Qwen3-MoE launches dozens of tiny kernels
per layer: each RMSNorm is about eight (casts, square, mean, rsqrt, two multiplies), the router's softmax, top-k
and renormalization five more. At decode batch sizes each takes a few microseconds whatever its size, and in
both modes alike, so they cap the FP4 speed-up (BENCHMARKS.md, session 10: about 2 ms of a 3-4 ms step).

``compile_small_modules`` compiles every RMSNorm and MoE router instance with ``nn.Module.compile`` (the instance
gets a compiled call; no class or function is replaced), so Inductor fuses each into one or two kernels. The
experts and the attention (this package's code: Triton kernels, the FP4 KV cache, the guidance recorder) stay
eager. Numerics: Inductor is told to round where the eager module rounds (``emulate_precision_casts``), so the
only difference left is the summation order of the RMSNorm mean: in the CPU tests the compiled backend generates
the eager one's tokens and routing, log-probs equal or within 1e-4; on a GPU, outputs agree within the model
dtype's rounding.
"""

from __future__ import annotations

import logging

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, Qwen3MoeTopKRouter

logger = logging.getLogger(__name__)

SMALL_MODULES = (Qwen3MoeRMSNorm, Qwen3MoeTopKRouter)
"""The module types ``compile_small_modules`` compiles."""
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
"""Inductor keeps the eager code's roundings to the model dtype (else it fuses them away)."""


def compile_like_eager(fn, *, dynamic: bool | None = None):
    """``torch.compile(fn)`` with ``INDUCTOR_OPTIONS``."""
    return torch.compile(fn, dynamic=dynamic, options=INDUCTOR_OPTIONS)


LAYER_TRACE_CONFIG = {"allow_unspec_int_on_nn_module": True, "recompile_limit": 64}
"""Dynamo settings while compiled layers run (``HFRolloutBackend.forward_context``): a layer's ``layer_idx`` is an
input, not a constant, so the layers share their graphs; and transformers' ``deprecate_kwarg`` wrapper, one code
object around both the decoder layer's and the attention's forward, gets a variant per caller and shape kind
(prefill / decode, batch), more than dynamo's default limit of 8, past which it would silently run eager."""


def _probe(x):
    return x


def compile_enabled() -> bool:
    """Whether ``torch.compile`` compiles in this process (it returns the function itself when dynamo is off, e.g.
    under ``TORCHDYNAMO_DISABLE=1``)."""
    return torch.compile(_probe) is not _probe


def _compile_all(modules: list[tuple[str, torch.nn.Module]], what: str, dynamic: bool | None) -> list[str]:
    """``nn.Module.compile`` each of ``modules`` (name, module) with ``INDUCTOR_OPTIONS``; their names, or [] with a
    warning where torch.compile is disabled in this process (nothing is compiled then, and nothing claims to be)."""
    if dynamic is not None and not isinstance(dynamic, bool):  # ("no" is truthy: dynamic shapes from the start)
        raise ValueError(f"dynamic={dynamic!r} must be None (torch.compile's default), True or False")
    if not compile_enabled():
        logger.warning("compile=%r, but torch.compile is disabled in this process (TORCHDYNAMO_DISABLE=1): the model "
                       "runs eager", what)
        return []
    for _, module in modules:
        module.compile(dynamic=dynamic, options=INDUCTOR_OPTIONS)
    logger.info("compile=%r: %d modules (%s)", what, len(modules),
                ", ".join(sorted({n.rsplit(".", 1)[-1] for n, _ in modules})))
    return [name for name, _ in modules]


def compile_small_modules(model: torch.nn.Module, *, dynamic: bool | None = None) -> list[str]:
    """Compile every ``SMALL_MODULES`` instance of ``model`` in place; returns their names (see ``_compile_all``).

    ``dynamic``: ``torch.compile``'s (None: static shapes first, dynamic after the first shape change, so prefill
    and decode steps of any batch share a few compiled graphs). Compilation happens on each module's first call.
    """
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, SMALL_MODULES)]
    if not modules:
        raise TypeError(f"{type(model).__name__} has no {' / '.join(t.__name__ for t in SMALL_MODULES)} to compile")
    return _compile_all(modules, "modules", dynamic)


def compile_layers(model: torch.nn.Module, *, dynamic: bool | None = None) -> list[str]:
    """Compile every decoder layer of ``model`` (``model.model.layers``) and its final norm in place; returns their
    names (see ``_compile_all``). Run the model inside ``torch._dynamo.config.patch(**LAYER_TRACE_CONFIG)``."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers to compile")
    modules = [(f"model.layers.{i}", layer) for i, layer in enumerate(layers)]
    if isinstance(getattr(inner, "norm", None), torch.nn.Module):
        modules.append(("model.norm", inner.norm))
    return _compile_all(modules, "layers", dynamic)
