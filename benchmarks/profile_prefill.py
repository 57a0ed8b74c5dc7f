"""GPU kernels of one prefill-heavy ``HFRolloutBackend.generate`` (capture on), by total time and by kind: where FP4
prefill on Hopper loses to BF16. Per variant one JSON line: the generate's wall time, its GPU kernel time, the time
per kind of kernel (``KINDS``, matched on the kernel name), the top kernels, the ops (with their input shapes)
whose kernels take the most GPU time, and where the device sat idle (``_gaps.idle_gaps``).
Variants (``VARIANTS``): bf16; fp4 as configured; fp4 with the experts' GEMMs on the FP4 codes at every size
(``dense_off``: ``experts.DENSE_FROM`` None, the Triton GEMM); the same with ``experts.PREFILL_WGMMA`` (``wgmma``);
fp4 without capture (``nocap``); fp4 and bf16 with the experts combine in PyTorch ops (``torch_combine``,
``bf16_torch_combine``: ``fp4_moe.COMBINE_KERNEL`` False). Usage (H200, carry .whl):
    python3 benchmarks/profile_prefill.py [--variants bf16,fp4,dense_off,wgmma,nocap] [--batch 8] [--prompt 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
from _gaps import idle_gaps
from bench_decode import (
    GENERATE_MODES,
    MODEL,
    SMOKE_MODEL,
    _sync,
    build_backends,
    generate_walls,
    model_config,
    random_prompts,
)
from torch.profiler import ProfilerActivity, profile

from megatron_trace.rollout import SamplingParams, experts, fp4_moe

KINDS = (  # (kind, substrings of the kernel name), first match wins; "enable_3x_kernel": PyTorch's CUTLASS kernels
    # (its bf16 grouped GEMM: sessions 29-30 counted them under dense_gemm)
    ("experts_gemm", ("fp4_gemm", "fp4_w4a16", "_moe_", "grouped_mm", "grouped_gemm", "cutlass3x", "enable_3x_kernel")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "softmax")),
    ("fp4_quant", ("quant", "pair_kernel", "fp4", "_rne", "guided", "record")),
    ("dense_gemm", ("gemm", "sm90_xmma", "nvjet", "cublas", "cutlass")),
    ("copy_cast", ("copy", "cast", "to_copy", "elementwise_kernel_with_index", "cat", "index")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "norm", "silu", "mul", "add")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


VARIANTS = {  # variant -> the (module, setting)s it runs with (the rest as configured); bf16* run the BF16 backend
    "bf16": {}, "bf16_torch_combine": {(fp4_moe, "COMBINE_KERNEL"): False}, "fp4": {},
    "torch_combine": {(fp4_moe, "COMBINE_KERNEL"): False}, "nocap": {}, "dense_off": {(experts, "DENSE_FROM"): None},
    "wgmma": {(experts, "PREFILL_WGMMA"): True, (experts, "DENSE_FROM_WGMMA"): None},
}


def launching_ops(prof, top: int) -> list:
    """The ops (with their input shapes) whose own kernels take the most GPU time."""
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]
    ops.sort(key=lambda e: -e.self_device_time_total)
    return [[f"{e.key} {e.input_shapes[:2]}"[:120], round(e.self_device_time_total / 1e3, 3), e.count]
            for e in ops[:top]]


def run(be, variant: str, batch: int, prompt: int, tokens: int, top: int, reps: int) -> dict:
    prompts = random_prompts(be, batch, prompt)
    sp = SamplingParams(max_new_tokens=tokens, seed=0, stop_token_ids=())
    guided = sorted(be._guided_layer_ids)
    saved = {(mod, k): getattr(mod, k) for mod, k in VARIANTS[variant]}
    be.set_guided_layers([] if variant == "nocap" else guided)
    for (mod, k), v in VARIANTS[variant].items():
        setattr(mod, k, v)
    try:
        walls = generate_walls(be, prompts, sp, reps)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if be.device.type == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            be.generate(prompts, sp)
            _sync(be.device)
    finally:
        be.set_guided_layers(guided)
        for (mod, k), v in saved.items():
            setattr(mod, k, v)
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda r: -r[1])
    kinds: dict[str, float] = {}
    for name, us, _ in rows:
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + us
    with tempfile.TemporaryDirectory() as tmp:  # (the device's idle gaps, from the profile's Chrome trace)
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        gaps = idle_gaps(path, top=12, min_us=50.0)
    return {"bench": "prefill_kernels", "variant": variant, "batch": batch, "prompt": prompt, "new_tokens": tokens,
            "wall_ms": round(statistics.median(walls) * 1e3, 2),
            "walls_ms": [round(w * 1e3, 1) for w in walls], "gpu_ms": round(sum(r[1] for r in rows) / 1e3, 2),
            "kinds_ms": {k: round(v / 1e3, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [[name[:100], round(us / 1e3, 3), n, kind_of(name)] for name, us, n in rows[:top]],
            "ops": launching_ops(prof, top), "idle": gaps}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--reps", type=int, default=3, help="unprofiled generates timed (wall_ms: their median)")
    p.add_argument("--static-decode", choices=("auto", "off", "eager", "graph"), default="off",
                   help="HFRolloutBackend(static_decode=...) (auto, the backend's default: CUDA graphs for FP4)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (no kernels to list)")
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:  # (refused before the model is built, not by a KeyError after it)
        p.error(f"--variants {a.variants!r}: {unknown} not among {tuple(VARIANTS)}")
    modes = sorted({"bf16" if v.startswith("bf16") else "fp4" for v in variants})
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = build_backends(model_config(dict(SMOKE_MODEL if a.smoke else MODEL), a.prompt + a.tokens + 64), modes,
                              device, dtype, static_decode=a.static_decode, known=GENERATE_MODES)
    for v in variants:
        be = backends["bf16" if v.startswith("bf16") else "fp4"]
        print(json.dumps(run(be, v, a.batch, a.prompt, a.tokens, a.top, a.reps)), flush=True)


if __name__ == "__main__":
    main()
