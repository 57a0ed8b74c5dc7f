"""Decode loop wall time with fixed-buffer steps (``rollout.static_decode``), eager and replayed as a CUDA graph.

Per mode and batch: a random prompt of ``--prompts`` tokens per row is prefilled into an ``FP4KVCache(static_rows)``,
then ``--steps`` greedy decode steps run through ``StaticDecode.step``, first eagerly, then (after ``capture``) as
graph replays, each with a fresh prefill. Prints one JSON line per point: ms per step of each loop, host time
included (what a rollout loop gets; the first ``WARMUP_STEPS`` untimed), and the tokens both loops generated agree
on. Usage (H200, carry .whl):
    python3 benchmarks/bench_static_decode.py [--modes bf16,fp4] [--batches 8,64] [--prompts 1024,8192] [--steps 64]
        [--shape qwen3-30b-a3b] [--compile layers] [--graph-only] [--gemm-grid auto|full] [--gemm auto|mma|triton]
        (--compile: TORCHDYNAMO_DISABLE=0)
The prefill runs in chunks of ``PREFILL_TOKENS`` tokens (batch x chunk).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_decode import GENERATE_MODES, MODEL, SHAPES, build_backends, model_config

from megatron_trace.kernels import moe_mma, moe_triton
from megatron_trace.rollout.static_decode import StaticDecode

WARMUP_STEPS = 4
"""Untimed first steps of each loop."""
PREFILL_TOKENS = 1 << 17
"""Tokens (batch x chunk) per prefill forward."""


def run_loop(be, batch: int, prompt: int, steps: int, graph: bool, seed: int) -> tuple[float, torch.Tensor]:
    """(seconds per decode step, generated tokens [B, steps])."""
    gen = torch.Generator(device=be.device).manual_seed(seed)
    ids = torch.randint(3, be.vocab_size, (batch, prompt), generator=gen, device=be.device)
    rows = -(-(prompt + steps + 1) // 16) * 16
    with be.forward_context() as model:
        cache = be.new_cache(interval_masks=True, static_rows=rows)
        chunk = max(1, PREFILL_TOKENS // batch)
        for s in range(0, prompt, chunk):  # (a long prefill in chunks: the MoE's routed rows fit the memory)
            out = model(input_ids=ids[:, s : s + chunk], use_cache=True, logits_to_keep=1, **be.cache_kwargs(cache))
        attn = torch.ones(batch, prompt, dtype=torch.bool, device=be.device)
        pos = torch.full((batch, 1), prompt - 1, dtype=torch.long, device=be.device)
        runner = StaticDecode(be, cache, attn, pos)
        if graph:
            runner.capture()
        tok, attend, toks = out.logits[:, -1].argmax(-1, keepdim=True), attn[:, 0], []
        for i in range(steps):
            if i == WARMUP_STEPS:  # (the first steps compile: Triton, Dynamo with --compile)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            tok = runner.step(tok, attend).argmax(-1, keepdim=True)
            toks.append(tok)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (steps - WARMUP_STEPS), torch.cat(toks, 1)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="bf16,fp4")
    p.add_argument("--batches", default="8,64")
    p.add_argument("--prompts", default="1024", help="prompt lengths (the context), outer loop")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--shape", choices=tuple(SHAPES), default="default")
    p.add_argument("--compile", choices=("modules", "layers"), default=None, help="HFRolloutBackend(compile=)")
    p.add_argument("--graph-only", action="store_true", help="no eager loop (the curve's points)")
    p.add_argument("--gemm-grid", choices=("auto", "full"), default="auto",
                   help="the FP4 expert GEMM's launch: auto (default: the compact grid and K slices of moe_slices) or "
                        "full (a program per column tile and expert, one K slice: before session 15)")
    p.add_argument("--gemm", choices=("auto", "mma", "triton"), default="auto",
                   help="the FP4 expert GEMM: auto (the default: moe_mma.AUTO as it is, on since session 26), mma "
                        "(the packed CUDA kernel where moe_mma.preferred: moe_mma.AUTO on) or triton (AUTO off)")
    a = p.parse_args(argv)
    if a.gemm != "auto":
        moe_mma.AUTO = a.gemm == "mma"
    moe_triton.AUTO_K_SLICES = moe_triton.COMPACT = a.gemm_grid == "auto"
    dims = dict(SHAPES.get(a.shape, MODEL))
    prompts = [int(v) for v in a.prompts.split(",")]
    backends = build_backends(model_config(dims, max(prompts) + a.steps + 64), a.modes.split(","),
                              torch.device("cuda"), torch.bfloat16, compile=a.compile or False,
                              known=GENERATE_MODES)
    rows = []
    for prompt, batch in ((p_, int(b)) for p_ in prompts for b in a.batches.split(",")):
        for mode, be in backends.items():
            replay, toks_g = run_loop(be, batch, prompt, a.steps, graph=True, seed=batch)
            row = {"bench": "static_decode", "mode": mode, "batch": batch, "prompt": prompt, "steps": a.steps,
                   "shape": a.shape, "compile": a.compile, "gemm_grid": a.gemm_grid, "gemm": a.gemm,
                   "graph_ms": round(replay * 1e3, 3),
                   "graph_tok_s": round(batch / replay, 1)}
            if not a.graph_only:
                eager, toks_e = run_loop(be, batch, prompt, a.steps, graph=False, seed=batch)
                row.update(eager_ms=round(eager * 1e3, 3), eager_tok_s=round(batch / eager, 1),
                           tokens_equal_fraction=round((toks_e == toks_g).float().mean().item(), 4))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
