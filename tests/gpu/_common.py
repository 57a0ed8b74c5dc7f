"""GPU-test helpers: the device and world of the tiny Megatron model, and moving guidance between devices.

``MEGATRON_TRACE_GPU_DRYRUN=1`` runs the GPU tests on CPU (gloo, CPU shims) to check their logic where no
GPU is available; without it they skip on a machine without CUDA.
"""

from __future__ import annotations

import dataclasses
import os

import torch

DRYRUN = os.environ.get("MEGATRON_TRACE_GPU_DRYRUN") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if DRYRUN else None)


def megatron_without_te() -> None:
    """Megatron-Core 0.16.1 reads ``moe_utils.te_general_gemm`` without TE, also on GPU (see megatron_cpu)."""
    from megatron_trace.testing.megatron_cpu import fix_router_without_te

    fix_router_without_te()


def move(obj, device):
    """A copy of a guidance dataclass (SiteGuidance, Full/CompactGuidance) with every tensor on ``device``."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if dataclasses.is_dataclass(obj):
        kw = {f.name: move(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        return type(obj)(**kw)
    return obj


def move_step(step, device):
    """StepGuidance with its records and routing on ``device``."""
    from megatron_trace.megatron import StepGuidance

    return StepGuidance(sites={k: move(v, device) for k, v in step.sites.items()},
                        routing={k: v.to(device) for k, v in step.routing.items()})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def perturb_non_experts(model, scale: float, seed: int = 1) -> None:
    """Relative noise on every non-expert parameter, drawn on the CPU (same noise on any device)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.device)
            p.add_((noise * scale * p.float().abs().mean()).to(p.dtype))


def capture_decode_step(be, new_cache, ids, tok, pos):
    """Prefill ``ids``, run one decode step (``tok`` at ``pos``) on a side stream, capture the next one in a CUDA
    graph; the same three calls eagerly on another cache give the wanted logits. Returns (graph, its output
    logits, wanted logits fp32, the captured cache). The caches write in place, so a replay repeats the step."""
    with be.forward_context() as model:
        def step(cache):
            return model(input_ids=tok, position_ids=pos, use_cache=True, **be.cache_kwargs(cache)).logits[:, -1]

        eager = new_cache()
        model(input_ids=ids, use_cache=True, **be.cache_kwargs(eager))
        step(eager)
        want = step(eager).float()
        cache = new_cache()
        model(input_ids=ids, use_cache=True, **be.cache_kwargs(cache))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(cache)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step(cache)
    return g, out, want, cache
