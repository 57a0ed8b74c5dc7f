"""Where the host time of ``HFRolloutBackend.generate`` goes (cProfile), per mode, on the decode benchmark's model.

The embedded rollout is host-bound on the GPU (eager ~40 ms per decode step against 4-7 ms of GPU work, see
BENCHMARKS.md), so its tokens/s is set by Python and launch overhead. Prints one JSON line per mode: the
functions with the most own time, and the megatron_trace / transformers functions with the most cumulative time
(with call counts), over one timed generate after a warm-up:
    python3 benchmarks/profile_generate.py [--modes bf16,fp4] [--batch 64] [--tokens 32] [--top 40]
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_decode import (
    GENERATE_MODES,
    MODEL,
    SMOKE_MODEL,
    build_backends,
    model_config,
    profiled_generate,
    random_prompts,
)

from megatron_trace.rollout import SamplingParams


def profile(be, batch: int, prompt: int, tokens: int, top: int) -> dict:
    prompts = random_prompts(be, batch, prompt)
    sp = SamplingParams(max_new_tokens=tokens, seed=0, stop_token_ids=())
    be.generate(prompts, sp)  # warm-up at full length: every Triton kernel variant compiled before the timed call
    sec, stats = profiled_generate(be, prompts, sp)
    stats = stats.stats
    rows = sorted(((v[2], v[1], f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}") for k, v in stats.items()), reverse=True)
    total = sum(v[2] for v in stats.values())
    ours = sorted(((v[3], v[1], f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}") for k, v in stats.items()
                   if "megatron_trace" in k[0] or "transformers" in k[0]), reverse=True)
    return {"sec": round(sec, 3), "own_total_s": round(total, 3), "per_step_ms": round(sec / (tokens + 1) * 1e3, 2),
            "top_own_ms": [[name, round(t * 1e3, 2), calls] for t, calls, name in rows[:top]],
            "top_cumulative_ms": [[name, round(t * 1e3, 2), calls] for t, calls, name in ours[:top]]}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="bf16,fp4")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dims = dict(SMOKE_MODEL if a.smoke else MODEL)
    backends = build_backends(model_config(dims, a.prompt + a.tokens + 64), a.modes.split(","), device, dtype,
                              known=GENERATE_MODES)
    out = []
    for mode, be in backends.items():
        row = {"bench": "profile_generate", "mode": mode, "batch": a.batch, "prompt": a.prompt, "tokens": a.tokens,
               "device": str(device), **profile(be, a.batch, a.prompt, a.tokens, a.top)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


if __name__ == "__main__":
    main()
