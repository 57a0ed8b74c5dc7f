"""MoE decode routing: the torch ops (sort, searchsorted, index_put) vs the one-launch Triton kernel, on one GPU.

Per (tokens, k, experts) point, one JSON line: ``graph_us`` (device microseconds per call: ``_timing.graph_ms``,
20 calls captured in one CUDA graph, L2 flushed before each, minus the flushes), ``eager_us`` (CUDA events around
one eager call, ``_timing.median_ms``: includes the host's launches when the GPU waits for them), both for
``fp4_moe._routing_torch`` and ``moe_routing_triton.routing``, whether the input ``fits`` the kernel, and whether
the two agree bit for bit. Points past ``fits`` are timed with ``MAX_WORK`` raised (``--max-work``), to see where
the limit should sit. Usage:
    python benchmarks/bench_routing.py [--points 8x8x32,8x8x128] [--max-work 1048576]
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import graph_ms, machine, median_ms

from megatron_trace.rollout import fp4_moe

POINTS = ((1, 8, 32), (8, 8, 32), (8, 8, 128), (16, 8, 128), (32, 8, 128), (8, 4, 16), (8, 8, 256), (1, 8, 1024),
          (64, 8, 128), (128, 8, 128))
"""(tokens, k, experts): decode batches of the tiny test model (E=32), Qwen3-30B-A3B (E=128) and larger; the last
two are past the kernel's default limit."""


def parse_points(text: str) -> list[tuple[int, int, int]]:
    """"TxKxE,..." -> [(T, k, E), ...]; a clear error naming the bad entry."""
    points = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--points entry {item!r} must be TOKENSxKxEXPERTS, e.g. 8x8x128")
        points.append(tuple(int(p) for p in parts))
    return points


def run_point(tokens: int, k: int, e: int, max_work: int) -> dict:
    """Times and agreement of both routings at one point (router-like ids: top-k of random logits), the kernel's
    ``MAX_WORK`` raised to ``max_work`` meanwhile."""
    from megatron_trace.kernels import moe_routing_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randn(tokens, e, generator=g, device="cuda").topk(k, dim=-1).indices  # [T, k] int64
    fits = moe_routing_triton.fits(tokens * k, e)
    saved = moe_routing_triton.MAX_WORK
    moe_routing_triton.MAX_WORK = max(saved, max_work)
    try:
        def torch_fn():
            return fp4_moe._routing_torch(idx, e)

        def kernel_fn():
            return moe_routing_triton.routing(idx, e)

        equal = all(torch.equal(a, b) for a, b in zip(kernel_fn(), torch_fn()))
        row = {"tokens": tokens, "k": k, "experts": e, "pairs": tokens * k, "fits": fits, "equal": equal}
        for name, fn in (("torch", torch_fn), ("kernel", kernel_fn)):
            row[f"{name}_graph_us"] = round(graph_ms(fn, calls=20, reps=5) * 1e3, 2)
            row[f"{name}_eager_us"] = round(median_ms(fn, warmup=5, reps=30) * 1e3, 2)
    finally:
        moe_routing_triton.MAX_WORK = saved
    row["graph_speedup"] = round(row["torch_graph_us"] / max(row["kernel_graph_us"], 1e-3), 2)
    row["eager_speedup"] = round(row["torch_eager_us"] / max(row["kernel_eager_us"], 1e-3), 2)
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default=None, help="TxKxE,... (default: POINTS)")
    p.add_argument("--max-work", type=int, default=1 << 20,
                   help="MAX_WORK while timing (points past the default limit run the kernel too)")
    args = p.parse_args(argv)
    points = parse_points(args.points) if args.points else POINTS
    if not torch.cuda.is_available():
        raise SystemExit("bench_routing.py needs a CUDA GPU (torch.cuda.is_available() is False); the kernel's "
                         "CPU check is TRITON_INTERPRET=1 pytest tests/kernels/test_moe_routing.py")
    info = machine()
    rows = []
    for tokens, k, e in points:
        try:
            row = run_point(tokens, k, e, args.max_work) | {"machine": info}
        except Exception as err:  # e.g. a point the kernel cannot compile: report it, time the others
            row = {"tokens": tokens, "k": k, "experts": e, "error": repr(err)[:300]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
