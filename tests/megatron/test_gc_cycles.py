"""No tensor waits for Python's cyclic GC: a training step (and a dropped model) frees its tensors by reference
counting alone. A cycle through a model holds all of its memory (weights, gradients) until a collection, which
Megatron-LM's ``--manual-gc`` runs only every N steps: on a GPU filled to the brim that is an OOM."""

import gc
from contextlib import contextmanager

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import (
    StepGuidance,
    check_finite,
    find_trace_layers,
    trace_guidance,
    trace_record,
    trace_spec,
)

from .harness import batch, build_model, perturb_non_experts, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")

QAT = TraceConfig()
GUIDED = TraceConfig(guided_layers="last_k", guided_last_k=2, cache_mode="compact")


@contextmanager
def cyclic_garbage():
    """Python's GC off inside; yields a list that, on exit, holds what only reference cycles kept alive."""
    gc.collect()
    gc.disable()
    found = []
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
    finally:
        gc.set_debug(0)
        gc.enable()
    found.extend(gc.garbage)
    gc.garbage.clear()


def _tensors(garbage: list) -> str:
    """The tensors in ``garbage`` (and what else the cycles held), for an assertion message; '' if none."""
    tensors = [o for o in garbage if isinstance(o, torch.Tensor)]
    if not tensors:
        return ""
    kinds = sorted({type(o).__qualname__ for o in garbage if isinstance(o, torch.nn.Module)})
    return f"{len(tensors)} tensors in cyclic garbage ({len(garbage)} objects; modules {kinds})"


def _model(tc):
    cfg = tiny_config()
    spec = stock_spec(cfg) if tc is None else trace_spec(stock_spec(cfg), tc)
    model = build_model(cfg, spec)
    if tc is not None:
        find_trace_layers(model)  # (as a training script does once)
    return model


def _guidance(model, data) -> StepGuidance:
    """Records of a perturbed copy (the rollout), which is dropped after recording."""
    rollout = _model(GUIDED)
    rollout.load_state_dict(model.state_dict())
    perturb_non_experts(rollout, 0.01)
    with trace_record(rollout, compact=True) as h, torch.no_grad():
        rollout(*data[:3])
    rec = h.recorded()
    return StepGuidance(sites=rec.sites, routing=rec.routing)


def _step(model, opt, data, guidance: StepGuidance | None, trace: bool) -> None:
    """One optimizer step as ``benchmarks/bench_qat_step.py``'s ``train_step_fn`` runs it."""
    tokens, pos, mask, labels = data
    opt.zero_grad(set_to_none=True)
    if guidance is None:
        model(tokens, pos, mask, labels=labels).float().mean().backward()
        if trace:
            check_finite(model)
    else:
        with trace_guidance(model, StepGuidance(sites=guidance.sites, routing=guidance.routing)):
            model(tokens, pos, mask, labels=labels).float().mean().backward()
    opt.step()


@pytest.mark.parametrize("arm", ["bf16_stock", "fp4_qat", "trace_guided"])
def test_a_training_step_and_a_dropped_model_leave_no_tensor_in_cycles(arm):
    tc = {"bf16_stock": None, "fp4_qat": QAT, "trace_guided": GUIDED}[arm]
    data = batch()
    with cyclic_garbage() as built:
        model = _model(tc)
        guidance = _guidance(model, data) if arm == "trace_guided" else None
    assert not _tensors(built), _tensors(built)  # (the guided arm's rollout model is dropped here)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(2):
        with cyclic_garbage() as stepped:
            _step(model, opt, data, guidance, trace=tc is not None)
        assert not _tensors(stepped), _tensors(stepped)
    with cyclic_garbage() as dropped:
        del model, opt
    assert not _tensors(dropped), _tensors(dropped)
