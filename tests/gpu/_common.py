"""GPU-test helpers: the device and world of the tiny Megatron model, and moving guidance between devices.

``MEGATRON_TRACE_GPU_DRYRUN=1`` runs the GPU tests on CPU (gloo, CPU shims) to check their logic where no
GPU is available; without it they skip on a machine without CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

DRYRUN = os.environ.get("MEGATRON_TRACE_GPU_DRYRUN") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if DRYRUN else None)


def metric(test: str, name: str, value) -> None:
    """One measured value as a JSON line in ``$MEGATRON_TRACE_METRICS`` (when set)."""
    path = os.environ.get("MEGATRON_TRACE_METRICS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "name": name, "value": value, "device": DEVICE}) + "\n")


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


def grouped_gemm_case(fmt, per_row, e, n, k, tokens_per_expert, seed=0, tail=3, scale=0.02):
    """(x bf16 [sum + tail, K], the FP4 weight [E, N, K], int32 offs) on the GPU: a grouped FP4 GEMM test case with
    ``tail`` rows that no expert owns."""
    from megatron_trace.formats import Quantizer

    gen = torch.Generator().manual_seed(seed)
    wq = Quantizer(fmt, per_row=per_row).quantize((torch.randn(e, n, k, generator=gen) * scale).cuda())
    tpe = torch.tensor(tokens_per_expert)
    offs = tpe.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(int(tpe.sum()) + tail, k, generator=gen).to(torch.bfloat16).cuda()
    return x, wq, offs


def experts_case(seed, e, h, ffn, tokens, k):
    """(experts module with bf16 gate_up_proj / down_proj, its ExpertWeightStore of layer 0, hidden, top-k ids,
    top-k weights) on the GPU: random experts and routing for the rollout's experts forward."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.experts import ExpertWeightStore

    gen = torch.Generator(device="cuda").manual_seed(seed)
    store = ExpertWeightStore(TraceConfig().weight_quantizer())
    m = torch.nn.Module()
    m.gate_up_proj = torch.nn.Parameter((torch.randn(e, 2 * ffn, h, generator=gen, device="cuda") * h**-0.5)
                                        .to(torch.bfloat16))
    m.down_proj = torch.nn.Parameter((torch.randn(e, h, ffn, generator=gen, device="cuda") * ffn**-0.5)
                                     .to(torch.bfloat16))
    for ex in range(e):
        store.quantize_from_params(m, 0, ex, "fc1")
        store.quantize_from_params(m, 0, ex, "fc2")
    hidden = torch.randn(tokens, h, generator=gen, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=gen, device="cuda")[:k] for _ in range(tokens)])
    wts = torch.softmax(torch.randn(tokens, k, generator=gen, device="cuda"), -1)
    return m, store, hidden, idx, wts
