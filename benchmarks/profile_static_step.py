"""GPU kernels of one fixed-buffer decode step (``rollout.static_decode``, eager: the kernels a graph replays), by
total time: where a point of ``bench_static_decode.py`` spends its step. Per (mode, batch, prompt): one JSON line
with the step's GPU microseconds and the top kernels. Usage (H200, carry .whl):
    python3 benchmarks/profile_static_step.py [--shape qwen3-30b-a3b] [--modes fp4] [--batches 1] [--prompts 1024,8192]
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_decode import GENERATE_MODES, MODEL, SHAPES, build_backends, model_config
from bench_static_decode import PREFILL_TOKENS
from torch.profiler import ProfilerActivity, profile

from megatron_trace.rollout.static_decode import StaticDecode


def kernels(be, batch: int, prompt: int, steps: int, top: int) -> dict:
    gen = torch.Generator(device=be.device).manual_seed(batch)
    ids = torch.randint(3, be.vocab_size, (batch, prompt), generator=gen, device=be.device)
    with be.forward_context() as model:
        cache = be.new_cache(interval_masks=True, static_rows=-(-(prompt + steps + 8) // 16) * 16)
        chunk = max(1, PREFILL_TOKENS // batch)
        for s in range(0, prompt, chunk):
            out = model(input_ids=ids[:, s : s + chunk], use_cache=True, logits_to_keep=1, **be.cache_kwargs(cache))
        attn = torch.ones(batch, prompt, dtype=torch.bool, device=be.device)
        runner = StaticDecode(be, cache, attn, torch.full((batch, 1), prompt - 1, device=be.device))
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):  # warm-up
            tok = runner.step(tok, attn[:, 0]).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                tok = runner.step(tok, attn[:, 0]).argmax(-1, keepdim=True)
            torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps, e.count // steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return {"step_gpu_us": round(sum(r[1] for r in rows), 1), "kernels_per_step": sum(r[2] for r in rows),
            "top": [[name[:90], round(us, 1), n] for name, us, n in rows[:top]]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--modes", default="fp4")
    p.add_argument("--batches", default="1")
    p.add_argument("--prompts", default="1024,8192")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=14)
    a = p.parse_args(argv)
    prompts = [int(v) for v in a.prompts.split(",")]
    dims = dict(SHAPES.get(a.shape, MODEL))
    backends = build_backends(model_config(dims, max(prompts) + 64), a.modes.split(","), torch.device("cuda"),
                              torch.bfloat16, known=GENERATE_MODES)
    for prompt in prompts:
        for batch in (int(b) for b in a.batches.split(",")):
            for mode, be in backends.items():
                row = {"bench": "static_step_kernels", "mode": mode, "batch": batch, "prompt": prompt,
                       **kernels(be, batch, prompt, a.steps, a.top)}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
