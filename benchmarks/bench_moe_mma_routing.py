"""The CUDA FP4 grouped GEMM (``moe_mma``) under random top-k routing, against the Triton kernel and bf16.

Decode batches route ``batch`` tokens to ``top_k`` distinct experts each, uniformly at random: some experts get no
token, the busiest several times the mean (``bench_moe_gemm.py`` and ``bench_moe_mma.py`` give every expert the same
count). Per shape, format and batch, one JSON line: device us of bf16 ``torch._grouped_mm``, the Triton kernel's
default launch, and the CUDA kernel on the plain and the packed (``moe_mma.pack``) layout, with the balanced split
(``moe_mma.BALANCED``) and without (``_grid``: one grid row per expert). CUDA graphs, L2 flushed (``_timing``).
Usage (H200):
    python3 benchmarks/bench_moe_mma_routing.py [--shapes qwen3_fc1,qwen3_fc2] [--fmt nvfp4]
        [--batches 1,4,16,32,64,128,256]
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import graph_ms, machine
from bench_moe_gemm import bf16_baseline
from bench_moe_skew import SHAPES, routing_offs

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fused, moe_mma, moe_triton


def run(name: str, fmt: str, batch: int, gen: torch.Generator) -> dict:
    e, k, n, top_k = SHAPES[name]
    offs = routing_offs(batch, e, top_k, gen)
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).cpu()
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq = fused.quantize(w, Quantizer(fmt), check_finite=False)[0]
    packed = moe_mma.pack(wq)
    x = torch.randn(int(offs[-1]), k, device="cuda", dtype=torch.bfloat16)
    row = {"bench": "moe_mma_routing", "shape": name, "fmt": fmt, "batch": batch, "rows": int(offs[-1]),
           "active_experts": int((counts > 0).sum()), "mean_tokens": round(int(offs[-1]) / e, 2),
           "max_tokens": int(counts.max())}
    bf16 = bf16_baseline(w)[0]
    row["bf16_us"] = round(graph_ms(lambda: bf16(x, offs)) * 1e3, 1)
    row["triton_us"] = round(graph_ms(lambda: moe_triton.grouped_mm(x, wq, offs)) * 1e3, 1)
    ref = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32)
    variants = (("mma", wq, True), ("mma_packed", packed, True), ("mma_packed_grid", packed, False))
    for label, weight, balanced in variants:
        moe_mma.BALANCED = balanced
        try:
            row[f"{label}_us"] = round(graph_ms(lambda wl=weight: moe_mma.grouped_mm(x, wl, offs)) * 1e3, 1)
            y = moe_mma.grouped_mm(x, weight, offs, out_dtype=torch.float32)
        finally:
            moe_mma.BALANCED = True
        row[f"{label}_rel_err"] = float(f"{float((y - ref).norm() / ref.norm()):.2e}")
    best = min(row["mma_us"], row["mma_packed_us"])
    row["packed_vs_triton"] = round(row["triton_us"] / row["mma_packed_us"], 2)
    row["best_mma_vs_bf16"] = round(row["bf16_us"] / best, 2)
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3_fc1,qwen3_fc2")
    p.add_argument("--fmt", default="nvfp4")
    p.add_argument("--batches", default="1,4,16,32,64,128,256")
    a = p.parse_args(argv)
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:  # (before: a KeyError at that shape, after the device time of the shapes before it)
        p.error(f"--shapes {a.shapes!r}: {unknown} not among {', '.join(SHAPES)}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            row = run(name, a.fmt, batch, gen) | {"machine": machine()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
