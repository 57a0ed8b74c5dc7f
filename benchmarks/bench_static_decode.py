"""Decode loop wall time with fixed-buffer steps (``rollout.static_decode``), eager and replayed as a CUDA graph.

Per mode and batch: a random prompt of ``--prompt`` tokens per row is prefilled into an ``FP4KVCache(static_rows)``,
then ``--steps`` greedy decode steps run through ``StaticDecode.step``, first eagerly, then (after ``capture``) as
graph replays, each with a fresh prefill. Prints one JSON line per point: ms per step of each loop, host time
included (what a rollout loop gets), and the tokens both loops generated agree on. Usage (H200, carry .whl):
    python3 benchmarks/bench_static_decode.py [--modes bf16,fp4] [--batches 8,64] [--prompt 1024] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_decode import MODEL, SHAPES, build_backends, model_config

from megatron_trace.rollout.static_decode import StaticDecode


def run_loop(be, batch: int, prompt: int, steps: int, graph: bool, seed: int) -> tuple[float, torch.Tensor]:
    """(seconds per decode step, generated tokens [B, steps])."""
    gen = torch.Generator(device=be.device).manual_seed(seed)
    ids = torch.randint(3, be.vocab_size, (batch, prompt), generator=gen, device=be.device)
    rows = -(-(prompt + steps + 1) // 16) * 16
    with be.forward_context() as model:
        cache = be.new_cache(interval_masks=True, static_rows=rows)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **be.cache_kwargs(cache))
        attn = torch.ones(batch, prompt, dtype=torch.bool, device=be.device)
        pos = torch.full((batch, 1), prompt - 1, dtype=torch.long, device=be.device)
        runner = StaticDecode(be, cache, attn, pos)
        if graph:
            runner.capture()
        tok, attend, toks = out.logits[:, -1].argmax(-1, keepdim=True), attn[:, 0], []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = runner.step(tok, attend).argmax(-1, keepdim=True)
            toks.append(tok)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, torch.cat(toks, 1)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="bf16,fp4")
    p.add_argument("--batches", default="8,64")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--shape", choices=tuple(SHAPES), default="default")
    a = p.parse_args(argv)
    dims = dict(SHAPES.get(a.shape, MODEL))
    backends = build_backends(model_config(dims, a.prompt + a.steps + 64), a.modes.split(","), torch.device("cuda"),
                              torch.bfloat16)
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        for mode, be in backends.items():
            eager, toks_e = run_loop(be, batch, a.prompt, a.steps, graph=False, seed=batch)
            replay, toks_g = run_loop(be, batch, a.prompt, a.steps, graph=True, seed=batch)
            row = {"bench": "static_decode", "mode": mode, "batch": batch, "prompt": a.prompt, "steps": a.steps,
                   "shape": a.shape, "eager_ms": round(eager * 1e3, 3), "graph_ms": round(replay * 1e3, 3),
                   "graph_tok_s": round(batch / replay, 1), "eager_tok_s": round(batch / eager, 1),
                   "tokens_equal_fraction": round((toks_e == toks_g).float().mean().item(), 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
