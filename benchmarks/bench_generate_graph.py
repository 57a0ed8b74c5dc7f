"""When a CUDA graph of the decode step pays for its capture: ``HFRolloutBackend.generate`` with its decode steps
captured and replayed (``static_decode="graph"``, the CUDA default: one capture per generate),
run eagerly on the same fixed buffers ("eager"), or on the dynamic cache ("off"), against the number of new tokens.

The decode benchmark's ~2.1B Qwen3-MoE (random weights), capture on. Per (mode, new tokens) one JSON line: the
median seconds of ``--reps`` generates per variant, the variants interleaved. Usage (H200, carry .whl):
    python3 benchmarks/bench_generate_graph.py [--modes bf16,fp4] [--batch 8] [--prompt 2048] [--tokens 1,4,16,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_decode import GENERATE_MODES, MODEL, SMOKE_MODEL, _sync, build_backends, model_config, random_prompts

from megatron_trace.rollout import SamplingParams

VARIANTS = ("graph", "eager", "off")


def point(be, batch: int, prompt: int, tokens: int, reps: int, variants) -> dict:
    prompts = random_prompts(be, batch, prompt)
    sp = SamplingParams(max_new_tokens=tokens, seed=0, stop_token_ids=())
    saved, secs = be.static_decode, {v: [] for v in variants}
    try:
        for rep in range(reps + 1):  # (round 0: warm-up)
            for v in variants:
                be.static_decode = v
                _sync(be.device)
                t0 = time.perf_counter()
                be.generate(prompts, sp)
                _sync(be.device)
                if rep:
                    secs[v].append(time.perf_counter() - t0)
    finally:
        be.static_decode = saved
    return {f"{v}_s": round(statistics.median(s), 4) for v, s in secs.items()} | {"secs": secs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="bf16,fp4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (graph left out)")
    a = p.parse_args(argv)
    unknown = [v for v in a.variants.split(",") if v not in VARIANTS]
    if unknown:  # (an unknown one ran the fixed-buffer steps eagerly under its own name)
        p.error(f"--variants {a.variants!r}: {unknown} not among {VARIANTS}")
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    variants = [v for v in a.variants.split(",") if device.type == "cuda" or v != "graph"]
    tokens = [int(t) for t in a.tokens.split(",")]
    backends = build_backends(model_config(dict(SMOKE_MODEL if a.smoke else MODEL), a.prompt + max(tokens) + 64),
                              a.modes.split(","), device, dtype, static_decode="eager",
                              known=GENERATE_MODES)
    for n in tokens:
        for mode, be in backends.items():
            row = point(be, a.batch, a.prompt, n, a.reps, variants)
            row["secs"] = {v: [round(s, 4) for s in ss] for v, ss in row["secs"].items()}
            print(json.dumps({"bench": "generate_graph", "mode": mode, "batch": a.batch, "prompt": a.prompt,
                              "new_tokens": n, **row}), flush=True)


if __name__ == "__main__":
    main()
