"""The W4A16 grouped GEMM under random top-k routing, where experts get unequal token counts (``bench_moe_gemm.py``
gives every expert the same count).

A program of ``fp4_gemm_kernel`` loops over its expert's tokens in tiles of BT and reads and dequantizes the expert's
weights once per tile, and the kernel lasts as long as its busiest program. So the token tile that is best for equal
counts can take two passes over the weights for the busiest experts of a real decode batch. Per shape and batch
(``batch`` tokens, each choosing ``top_k`` distinct experts uniformly), prints one JSON line: the mean and largest
tokens per expert, device time of the default config (``moe_triton.default_config``) and of each config in ``CONFIGS``
below, and bf16 ``torch._grouped_mm`` on the same routing. Usage (H200):
    python3 benchmarks/bench_moe_skew.py [--shapes e2e_fc1,e2e_fc2,qwen3_fc1,qwen3_fc2] [--batches 1,2,4,8,16,32,64,128]
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import graph_ms, machine
from bench_moe_gemm import bf16_baseline

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fused, moe_triton

SHAPES = {  # name: (experts, K, N, top_k) as [E, N, K] FP4 weights
    "e2e_fc1": (32, 2048, 1536, 8),  # bench_decode.py's default model
    "e2e_fc2": (32, 768, 2048, 8),
    "qwen3_fc1": (128, 2048, 1536, 8),  # Qwen3-30B-A3B
    "qwen3_fc2": (128, 768, 2048, 8),
    "dsv3_fc1": (256, 7168, 4096, 8),  # DeepSeek-V3 (bench_moe_mma_routing.py)
}
CONFIGS = {"bt16": (128, 128, 16, 4, 4), "bt32": (128, 128, 32, 4, 4), "bt64": (128, 128, 64, 8, 4),
           "bt128": (128, 128, 128, 8, 3), "bn64_bt16": (64, 128, 16, 4, 4), "bn64_bt16_s3": (64, 128, 16, 4, 3),
           "bn32_bt16": (32, 128, 16, 4, 4), "bn32_bt16_w2": (32, 128, 16, 2, 4), "bt16_w8": (128, 128, 16, 8, 4)}
"""Token tiles (BT) 16-128 at BN 128, and BN 64 (twice the programs: at batch 8 on 128 experts about 50 experts
are active, so BN 128 gives 600 fc1 programs for 528 resident slots, 1.14 waves) and BN 32 (for batch 1-4: at
batch 1, 8 active experts x 12 fc1 column tiles of 128 are 96 programs on 132 multiprocessors, 0.12 of copy in
session 14's profile), and 8 warps at BT 16 (two warpgroups of 64 rows). All with one K slice and a program per
(column tile, expert) (the full grid)."""
K_SLICES = (2, 3, 4, 8)
"""The 16-token tile at BN 128 (``bt16``) with K split over this many programs (``moe_slices``), where the count
divides the shape's K tiles: columns ``bt16_k{S}_us`` (full grid) and ``bt16_k{S}_c_us`` (the COMPACT grid of
``moe_slices.compact_programs`` programs over the experts with tokens); ``bt16_c_us``: one slice, compact;
``bn64_bt16_k{S}_us``: BN 64 with S = 2, 4 slices on the full grid."""


def routing_offs(batch: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """int32 cumulative token counts per expert of ``batch`` tokens choosing ``top_k`` distinct experts each."""
    choice = torch.rand(batch, experts, generator=gen).topk(top_k, dim=1).indices
    counts = torch.bincount(choice.flatten(), minlength=experts)
    return counts.cumsum(0).to(torch.int32).cuda()


def run(name: str, batch: int, gen: torch.Generator) -> dict:
    e, k, n, top_k = SHAPES[name]
    offs = routing_offs(batch, e, top_k, gen)
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).cpu()
    t = int(offs[-1])
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq = fused.quantize(w, Quantizer("nvfp4"), check_finite=False)[0]
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    cfg = moe_triton.default_config(t, e, k)[0]
    slices, programs = moe_triton.launch_defaults(t, e, n, k, cfg, x.device)
    row = {"bench": "moe_skew", "shape": name, "experts": e, "K": k, "N": n, "batch": batch, "rows": t,
           "mean_tokens": round(t / e, 2), "max_tokens": int(counts.max()), "default": list(cfg),
           "default_k_slices": slices, "default_programs": programs}
    row["default_us"] = round(graph_ms(lambda: moe_triton.grouped_mm(x, wq, offs)) * 1e3, 1)
    for label, cfg in CONFIGS.items():
        row[f"{label}_us"] = round(graph_ms(lambda c=cfg: moe_triton.grouped_mm(x, wq, offs, config=c, k_slices=1,
                                                                                programs=0)) * 1e3, 1)
    k_tiles = -(-k // CONFIGS["bt16"][1])
    for s in (1, *(s for s in K_SLICES if k_tiles % s == 0)):
        for grid in ("full", "compact") if s > 1 else ("compact",):
            label = f"bt16{f'_k{s}' if s > 1 else ''}{'_c' if grid == 'compact' else ''}"
            row[f"{label}_us"] = round(graph_ms(lambda s=s, g=grid: moe_triton.grouped_mm(
                x, wq, offs, config=CONFIGS["bt16"], k_slices=s, programs=0 if g == "full" else None)) * 1e3, 1)
    for s in (2, 4):  # BN 64 with K slices, full grid
        if k_tiles % s == 0:
            row[f"bn64_bt16_k{s}_us"] = round(graph_ms(lambda s=s: moe_triton.grouped_mm(
                x, wq, offs, config=CONFIGS["bn64_bt16"], k_slices=s, programs=0)) * 1e3, 1)
    bf16, row["bf16_layout"] = bf16_baseline(w)
    row["bf16_us"] = round(graph_ms(lambda: bf16(x, offs)) * 1e3, 1)
    best = min((c[:-3] for c in row if c.endswith("_us") and c not in ("default_us", "bf16_us")),
               key=lambda c: row[f"{c}_us"])
    row["active_experts"] = int((counts > 0).sum())
    row["best"], row["default_vs_best"] = best, round(row["default_us"] / row[f"{best}_us"], 3)
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    a = p.parse_args(argv)
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:  # (before: a KeyError at that shape, after the device time of the shapes before it)
        p.error(f"--shapes {a.shapes!r}: {unknown} not among {', '.join(SHAPES)}")
    print(json.dumps({"bench": "moe_skew_setup", **machine()}), flush=True)
    gen = torch.Generator().manual_seed(0)
    out = []
    for name in a.shapes.split(","):
        for b in (int(v) for v in a.batches.split(",")):
            row = run(name, b, gen)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


if __name__ == "__main__":
    main()
