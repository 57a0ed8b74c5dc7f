"""One training step (forward + backward + AdamW) of a Megatron MoE GPTModel: BF16 vs FP4 QAT vs TRACE guided.

    python3 benchmarks/bench_qat_step.py            # H200: 8 layers, hidden 1024, 32 experts top-4, ffn 512,
                                                     # seq 1024, batch 8, bf16
    python3 benchmarks/bench_qat_step.py --smoke    # tiny, runs on CPU (checks the script, times nothing useful)
    python3 benchmarks/bench_qat_step.py --profile  # + per variant: host-blocking calls and top ops of one step
    python3 benchmarks/bench_qat_step.py --sync-sites  # + per variant: host syncs of one step by source line
    python3 benchmarks/bench_qat_step.py --host-profile  # + per variant: host time of one step by function
    python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided
                                                     # 4 layers of Qwen3-30B-A3B's MoE shape (see PRESETS)

Variants: bf16_stock (Megatron's local spec: SequentialMLP loop), bf16_grouped (TRACE experts with no site
quantized: the same grouped GEMM as QAT, isolates the quantization cost), fp4_qat[kernel] (TRACE spec, all
sites, own RNE), trace_guided[kernel] (records from a perturbed forward, compact, deepest half of the layers,
routing replay). All variants are built first, then timed in interleaved rounds (one step of each per round)
after warm-up rounds: medians (CUDA events on GPU) and the median of the per-round ratios. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from benchmarks._megatron import gpt, init_world, lm_batch, moe_config, perturb_non_experts, stock_spec  # noqa: E402
from benchmarks._timing import interleaved_ms, median  # noqa: E402

SHAPE = ("layers", "hidden", "experts", "topk", "moe_ffn", "seq", "batch", "heads", "groups", "vocab")
PRESETS = {
    # the MoE layer of Qwen3-30B-A3B (hidden 2048, 128 experts top-8, expert ffn 768, 4 KV heads of 128), 4 of its
    # 48 layers, 8192 tokens per step; q width 2048 (the model's is 4096) and vocab 32768 (151936) keep the
    # attention and the LM head from dominating a 4-layer slice
    "qwen3-30b-a3b": dict(layers=4, hidden=2048, experts=128, topk=8, moe_ffn=768, seq=2048, batch=4, heads=16,
                          groups=4, vocab=32768),
}
VARIANTS = ("bf16_stock", "bf16_grouped", "fp4_qat", "trace_guided")


def args_():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in dict(layers=8, hidden=1024, experts=32, topk=4, moe_ffn=512, seq=1024, batch=8, heads=16, groups=4,
                     vocab=32768, warmup=3, reps=10).items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--preset", choices=sorted(PRESETS), help="a model shape (overrides the shape flags)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"which of {', '.join(VARIANTS)} to time")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="forward + backward passes per optimizer step; > 1 also times the TRACE variants with "
                        "reuse_weight_quant (+reuse: the experts' weights fake-quantized once per step)")
    p.add_argument("--gc", choices=("auto", "manual"), default="auto",
                   help="manual: freeze Python's GC after warm-up and collect between rounds (Megatron's --manual-gc)")
    p.add_argument("--kernels", default="auto,reference", help="TraceConfig.kernel values to time")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU allowed")
    p.add_argument("--profile", action="store_true",
                   help="also profile one step per variant: host syncs, device time, top ops (torch.profiler)")
    p.add_argument("--profile-top", type=int, default=20, help="with --profile: how many top ops to list")
    p.add_argument("--drain", action="store_true",
                   help="also time the TRACE variants with the stream synchronized before the step's NaN/Inf check "
                        "(+drain: how the check read its counters before session 20)")
    p.add_argument("--stack-copy", action="store_true",
                   help="also time the TRACE-experts variants with their weights stacked by a copy each forward "
                        "(+stack: torch.stack, as before session 21's packed weights, expert_weights.VIEWS=False)")
    p.add_argument("--host-profile-dir", help="with --host-profile: also write each variant's raw profile there")
    p.add_argument("--late-weights", action="store_true",
                   help="also time the TRACE-experts variants with their weights quantized after the dispatcher's "
                        "host sync (+late: experts.EARLY_WEIGHTS=False, as before session 23)")
    p.add_argument("--prechecked", action="store_true",
                   help="also time the guided variants with records whose scales were checked before the step "
                        "(+checked: as records assembled from the guidance cache are; the step skips scales_ok)")
    p.add_argument("--gaps", action="store_true",
                   help="also profile one step per variant between two syncs: the GPU idle time and the host ops "
                        "that launched the kernel after each gap (_gaps.idle_gaps)")
    p.add_argument("--host-profile", action="store_true",
                   help="also cProfile one step per variant: host time by Python function (host-bound steps)")
    p.add_argument("--sync-sites", action="store_true",
                   help="also count the host syncs of one step per variant by source line (CUDA sync debug mode)")
    a = p.parse_args()
    if a.preset:
        a.__dict__.update(PRESETS[a.preset])
    unknown = set(a.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants {sorted(unknown)} unknown; choose from {', '.join(VARIANTS)}")
    if a.smoke:
        a.__dict__.update(layers=2, hidden=64, experts=4, topk=2, moe_ffn=64, seq=32, batch=2, heads=4, groups=2,
                          vocab=128, warmup=1, reps=2)
    return a


def unquantized_trace_spec(spec):
    """TRACE experts (grouped GEMM) with no site quantized."""
    from megatron_trace.config import TraceConfig

    off = TraceConfig(sites=(), guided_sites=())
    for ls in spec.layer_specs:
        ex = ls.submodules.mlp.submodules.experts
        ex.params = {**ex.params, "trace_config": off}
    return spec


def train_step_fn(model, data, step_guidance=None, trace: bool = False, micro_batches: int = 1,
                  reuse: bool = False, opt=None, drain: bool = False):
    """One optimizer step over ``micro_batches`` forward + backward passes (gradient accumulation); ``trace``: a
    TRACE model without guidance runs ``check_finite`` before the optimizer (its one host sync per step, as a
    training loop would), a guided step checks at each context exit. ``reuse``: the micro-batches run inside
    ``reuse_weight_quant`` (the experts' weights fake-quantized once per step). ``drain``: the stream is synchronized
    before the step's check, as the check's own read did before session 20 (``checks.ReadyPoint``)."""
    from contextlib import nullcontext

    from torch.profiler import record_function

    from megatron_trace.megatron import StepGuidance, check_finite, reuse_weight_quant, trace_guidance

    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-5, fused=data[0].is_cuda)
    tokens, pos, mask, labels = data

    def fwd_bwd():
        with record_function("step:forward"):
            loss = model(tokens, pos, mask, labels=labels).float().mean()
        with record_function("step:backward"):
            loss.backward()

    def step():
        opt.zero_grad(set_to_none=True)
        with reuse_weight_quant(model) if reuse else nullcontext():
            for _ in range(micro_batches):
                if step_guidance is None:
                    fwd_bwd()
                else:
                    sg = StepGuidance(sites=step_guidance.sites, routing=step_guidance.routing)
                    with record_function("step:trace_guidance"), trace_guidance(model, sg):
                        fwd_bwd()
                        if drain:
                            torch.cuda.current_stream().synchronize()
        if trace and step_guidance is None:
            with record_function("step:check_finite"):
                if drain:
                    torch.cuda.current_stream().synchronize()
                check_finite(model)
        with record_function("step:optimizer"):
            opt.step()

    return step


def _allocator_facts() -> dict:
    """What the caching allocator did over the whole run: retries (a failed allocation frees the cache and
    synchronizes, which would slow the step it lands in) and cudaMalloc / cudaFree calls."""
    st = torch.cuda.memory_stats()
    return {"num_alloc_retries": st.get("num_alloc_retries"), "num_device_alloc": st.get("num_device_alloc"),
            "num_device_free": st.get("num_device_free"),
            "peak_reserved_gb": round(st.get("reserved_bytes.all.peak", 0) / 2**30, 2),
            "total_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2)}


def _switched_off(step, module, flag: str):
    """``step`` with the switch ``module.flag`` off while it runs (the path before a session's change)."""

    def run():
        setattr(module, flag, False)
        try:
            return step()
        finally:
            setattr(module, flag, True)

    return run


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")
"""Runtime calls that block the host (``cudaMemcpyAsync`` to pageable host memory: ``.item()``, ``.tolist()``)."""


LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


def profile_step(fn, device: str, top: int = 20) -> dict:
    """One profiled step after one warm-up: host-blocking runtime calls, device time and the top ops by self
    device (CPU off CUDA) time. Host syncs are what make a guided step slower than its GPU work."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
    ev = prof.key_averages()
    dev = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    ops = sorted((e for e in ev if getattr(e, dev, 0) > 0), key=lambda e: getattr(e, dev), reverse=True)
    host = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)
    kernels = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "host_blocking_calls": {e.key: e.count for e in ev if e.key in SYNC_EVENTS},
        "self_time_ms_total": round(sum(getattr(e, dev) for e in ev) / 1e3, 3),
        "kernel_ms_total": round(sum(e.self_device_time_total for e in kernels) / 1e3, 3),  # (GPU busy time)
        "kernels": sum(e.count for e in kernels),
        "top_ops_ms": [[e.key[:80], round(getattr(e, dev) / 1e3, 3), e.count] for e in ops[:top]],
        "host_self_ms_total": round(sum(e.self_cpu_time_total for e in ev) / 1e3, 3),
        "host_launches": sum(e.count for e in ev if e.key in LAUNCH_EVENTS),
        "top_host_ops_ms": [[e.key[:80], round(e.self_cpu_time_total / 1e3, 3), e.count] for e in host[:top]],
    }


def step_gaps(fn, top: int = 20) -> dict:
    """One step (after one warm-up) profiled from an idle GPU to its end, without Python's cyclic GC:
    ``_gaps.idle_gaps`` of its trace."""
    import gc
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from benchmarks._gaps import idle_gaps

    fn()
    torch.cuda.synchronize()
    gc.collect()  # (a collection inside the profiled step would show as one long gap)
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        gc.enable()
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        return idle_gaps(tmp.name, top)


def host_profile(fn, top: int = 25, dump: str | None = None) -> dict:
    """One step under cProfile (after one warm-up, synchronized): the functions with the most host time,
    by own time (tottime) and, for the project's functions, by cumulative time; ``dump``: also the raw
    profile there (``pstats.Stats(dump).print_callees(...)`` for what a function spends its time on)."""
    import cProfile
    import pstats

    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    if dump:
        prof.dump_stats(dump)
    st = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    name = lambda k: f"{os.path.basename(k[0])}:{k[1]} {k[2]}"  # noqa: E731
    rows = [(name(k), v[1], v[2], v[3], "megatron_trace" in k[0]) for k, v in st.items()]
    ms = lambda t: round(t * 1e3, 2)  # noqa: E731
    return {
        "total_ms": ms(sum(r[2] for r in rows)),
        "by_own_ms": [[n, c, ms(t)] for n, c, t, _, _ in sorted(rows, key=lambda r: -r[2])[:top]],
        "project_by_cumulative_ms": [[n, c, ms(cu)] for n, c, _, cu, ours in sorted(rows, key=lambda r: -r[3])
                                     if ours][:top],
    }


def sync_sites(fn, top: int = 25) -> dict:
    """Host syncs of one step (after one warm-up) by the innermost project source line that caused them
    (``torch.cuda.set_sync_debug_mode("warn")``); lines outside the project are grouped as ``torch/megatron``."""
    import traceback
    import warnings

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    counts: dict[str, int] = {}

    def where() -> str:
        frames = [f for f in traceback.extract_stack()
                  if f.filename.startswith(root) and "bench_qat_step" not in f.filename]
        if not frames:
            return "torch/megatron"
        f = frames[-1]
        return f"{os.path.relpath(f.filename, root)}:{f.lineno} {f.name}"

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            k = where()
            counts[k] = counts.get(k, 0) + 1

    fn()
    old = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return {"total": sum(counts.values()), "by_site": ranked[:top]}


def guidance_for(model, trace_cfg, cfg, a, device, data):
    """Compact records of a perturbed copy (the 'rollout'), restricted to the guided layers; all routing."""
    from megatron_trace.guidance.selection import guided_layers
    from megatron_trace.megatron import StepGuidance, trace_record, trace_spec

    rollout = gpt(cfg, trace_spec(stock_spec(cfg), trace_cfg), a, device)
    rollout.load_state_dict(model.state_dict())
    perturb_non_experts(rollout, 0.01)
    tokens, pos, mask, _ = data
    with trace_record(rollout, compact=True) as h, torch.no_grad():
        rollout(tokens, pos, mask)
    rec = h.recorded()
    keep = set(guided_layers(trace_cfg, cfg.num_layers))
    del rollout
    return StepGuidance(sites={k: v for k, v in rec.sites.items() if k[0] in keep}, routing=rec.routing), sorted(keep)


def main():
    a = args_()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not a.smoke:
        raise SystemExit("no CUDA: run with --smoke on CPU")
    init_world(device)
    from megatron_trace.config import TraceConfig
    from megatron_trace.kernels import select_kernel
    from megatron_trace.megatron import expert_weights, experts, find_trace_layers, trace_spec

    cfg = moe_config(a, device)
    data = lm_batch(a, device)
    want = a.variants.split(",")
    variants = {"bf16_stock": (None, False), "bf16_grouped": ("unquantized", False)}
    for k in a.kernels.split(","):
        variants[f"fp4_qat[{k}]"] = (TraceConfig(kernel=k), False)
        variants[f"trace_guided[{k}]"] = (TraceConfig(kernel=k, guided_layers="fraction", guided_fraction=0.5,
                                                      cache_mode="compact"), True)
    variants = {n: v for n, v in variants.items() if n.split("[")[0] in want}
    fns, extra = {}, {}
    for name, (tc, guided) in variants.items():
        if tc is None:
            spec = stock_spec(cfg)
        elif tc == "unquantized":
            spec = unquantized_trace_spec(trace_spec(stock_spec(cfg), TraceConfig(sites=("weights",), guided_sites=())))
        else:
            spec = trace_spec(stock_spec(cfg), tc)
        model = gpt(cfg, spec, a, device)
        if tc is not None:  # (as a training script does once: exclusions, the experts' weight hooks)
            find_trace_layers(model)
        sg = None
        if guided:
            sg, layers = guidance_for(model, tc, cfg, a, device, data)
            extra["guided_layers"] = layers
        trace = isinstance(tc, TraceConfig)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
        fns[name] = train_step_fn(model, data, sg, trace, a.micro_batches, opt=opt)
        if trace and a.micro_batches > 1:  # the same model and optimizer, the weights quantized once per step
            fns[name.replace("[", "+reuse[")] = train_step_fn(model, data, sg, trace, a.micro_batches, True, opt)
        for on, tag, module, flag in ((a.stack_copy, "+stack", expert_weights, "VIEWS"),
                                      (a.late_weights, "+late", experts, "EARLY_WEIGHTS")):
            if tc is not None and on:
                fns[name.replace("[", tag + "[") if "[" in name else name + tag] = _switched_off(
                    train_step_fn(model, data, sg, trace, a.micro_batches, opt=opt), module, flag)
        if guided and a.prechecked:
            checked = {k: dataclasses.replace(v, scales_checked=True) for k, v in sg.sites.items()}
            fns[name.replace("[", "+checked[")] = train_step_fn(model, data, dataclasses.replace(sg, sites=checked),
                                                                 trace, a.micro_batches, opt=opt)
        if trace and a.drain and device == "cuda":
            fns[name.replace("[", "+drain[")] = train_step_fn(model, data, sg, trace, a.micro_batches, opt=opt,
                                                               drain=True)
    times = interleaved_ms(fns, device, a.warmup, a.reps, manual_gc=a.gc == "manual")
    ms = {name: median(t) for name, t in times.items()}
    for name in fns:
        print(f"{name}: {ms[name]:.2f} ms/step", file=sys.stderr, flush=True)
    for name, fn in fns.items():
        if a.profile:
            extra.setdefault("profile", {})[name] = profile_step(fn, device, a.profile_top)
        if a.gaps and device == "cuda":
            extra.setdefault("gaps", {})[name] = step_gaps(fn, a.profile_top)
        if a.host_profile:
            dump = a.host_profile_dir and os.path.join(a.host_profile_dir, re.sub(r"\W", "_", name) + ".pstats")
            extra.setdefault("host_profile", {})[name] = host_profile(fn, dump=dump)
        if a.sync_sites and device == "cuda":
            extra.setdefault("sync_sites", {})[name] = sync_sites(fn)
    pairs = [(f"trace_guided{r}[{k}]", f"fp4_qat{r}[{k}]") for k in a.kernels.split(",") for r in ("", "+reuse")]
    pairs += [(f"{v}{r}[{k}]", "bf16_grouped") for v in ("fp4_qat", "trace_guided") for k in a.kernels.split(",")
              for r in ("", "+reuse", "+drain")]
    pairs += [(f"{v}[{k}]", f"{v}+drain[{k}]") for v in ("fp4_qat", "trace_guided") for k in a.kernels.split(",")]
    pairs += [(f"trace_guided{x}[{k}]", y.format(k=k)) for k in a.kernels.split(",") for x, y in (
        ("+checked", "fp4_qat[{k}]"), ("+checked", "bf16_grouped"), ("", "trace_guided+checked[{k}]"))]
    for tag in ("+stack", "+late"):
        pairs += [(f"{v}[{k}]", f"{v}{tag}[{k}]") for v in ("fp4_qat", "trace_guided") for k in a.kernels.split(",")]
        pairs += [("bf16_grouped", f"bf16_grouped{tag}")]
    pairs += [("bf16_grouped+stack", "bf16_stock")]
    pairs += [(f"{v}+late[{k}]", "bf16_grouped+late") for v in ("fp4_qat", "trace_guided")
              for k in a.kernels.split(",")]
    extra["round_ratio_median"] = {f"{x}/{y}": round(median([p / q for p, q in zip(times[x], times[y])]), 3)
                                   for x, y in pairs if x in times and y in times}
    base = ms.get("bf16_stock")
    resolved = {k: select_kernel(k, device).value for k in a.kernels.split(",")}
    out = {
        "bench": "qat_step", "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "smoke": a.smoke,
        "preset": a.preset, "shape": {k: getattr(a, k) for k in SHAPE}, "gc": a.gc, "micro_batches": a.micro_batches,
        "warmup": a.warmup, "reps": a.reps, "kernel_resolved": resolved, **extra,
        "step_ms": {k: round(v, 3) for k, v in ms.items()},
        "step_ms_rounds": {k: [round(t, 2) for t in v] for k, v in times.items()},
        "cuda_memory": _allocator_facts() if device == "cuda" else None,
        "ratio_vs_bf16_stock": {k: round(v / base, 3) for k, v in ms.items()} if base else None,
        "ratio_vs_bf16_grouped": ({k: round(v / ms["bf16_grouped"], 3) for k, v in ms.items()}
                                  if "bf16_grouped" in ms else None),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
