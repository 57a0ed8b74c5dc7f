"""Around a training step: the experts' weights fake-quantized once for all its micro-batches
(``reuse_weight_quant``, see ``weight_reuse``) and the Megatron-LM train-step hook (``trace_train_step``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from .context import check_finite, find_trace_layers
from .experts import TraceSequentialMLP


@contextmanager
def reuse_weight_quant(model) -> Iterator[None]:
    """Fake-quantize the routed experts' weights once for all micro-batches run inside (gradient accumulation):
    ``with reuse_weight_quant(model): for mb in micro_batches: forward + backward``, then the optimizer step
    outside. Same gradients bit for bit (straight-through, ``TraceConfig.ste_clip=False``); the kept weights
    cost one bf16 copy of the local experts until the scope exits. Torch experts only (TE fetches its own)."""
    layers = find_trace_layers(model)
    experts = [moe.experts for moe in layers.moe.values()]
    if layers.config.ste_clip:
        raise ValueError("reuse_weight_quant needs TraceConfig.ste_clip=False (the clipped STE needs each "
                         "micro-batch's mask)")
    if any(not isinstance(e, TraceSequentialMLP) for e in experts):
        raise ValueError("reuse_weight_quant supports the torch experts (TraceSequentialMLP); TE experts fetch and "
                         "quantize their weights per call")
    if any(e._weight_reuse is not None for e in experts):
        raise RuntimeError("reuse_weight_quant scopes do not nest: this model is already inside one")
    try:
        for e in experts:
            e._weight_reuse = {}
        yield
    finally:
        for e in experts:
            e._weight_reuse = None


@contextmanager
def trace_train_step(args, model) -> Iterator[None]:
    """Megatron-LM's ``train_step`` around ``forward_backward_func`` (patches/): with ``--trace-fp4``, the
    micro-batches run inside ``reuse_weight_quant`` when ``--trace-reuse-weight-quant`` is given, and the step's
    deferred NaN/Inf check (``check_finite``) runs after the last backward, before the optimizer step."""
    if not getattr(args, "trace_fp4", False):
        yield
        return
    with reuse_weight_quant(model) if getattr(args, "trace_reuse_weight_quant", False) else nullcontext():
        yield
    check_finite(model)
