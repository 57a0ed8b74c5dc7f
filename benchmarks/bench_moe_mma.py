"""The CUDA (mma.sync) FP4 grouped GEMM's build variants against the Triton kernel and bf16 ``torch._grouped_mm``.

Variants are ``moe_mma.DEFINES`` macro sets (``MIN_BLOCKS=1``: registers for one CTA per multiprocessor;
``SKIP_DEQUANT=1``: no dequantization, wrong numbers, the time of everything else; ``PROBE_CONTIGUOUS=1``: each
warp step's weight bytes read as one contiguous block, wrong numbers, a DRAM-locality probe). Errors are against
the fp32 reference (DeepSeek-V3's shape: against the Triton kernel's fp32 output). All experts get the same number
of tokens. Prints one JSON line (device time per call, CUDA graphs with the L2 flushed, and the weight-read rate as a
fraction of the copy bandwidth measured in the same run). ``--packed`` also times each variant on the weights in
``moe_mma.pack``'s layout (key ``packed:<variant>``); ``--grid`` also with one grid row of CTAs per expert (``grid:``).
Usage:
    python benchmarks/bench_moe_mma.py [--shapes qwen3_fc1,qwen3_fc2] [--tokens 1,4,16] [--fmt nvfp4]
        [--variants ,MIN_BLOCKS=1,SKIP_DEQUANT=1] [--packed] [--grid]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _timing import copy_bandwidth, graph_ms, machine
from bench_moe_gemm import SHAPES, bf16_baseline

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fused, grouped_mm_reference, moe_mma, moe_triton


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3_fc1,qwen3_fc2")
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--fmt", default="nvfp4")
    p.add_argument("--variants", default=",MIN_BLOCKS=1,SKIP_DEQUANT=1",
                   help="comma-separated; each a '+'-joined list of NAME=value macros ('' : the default build)")
    p.add_argument("--packed", action="store_true", help="also time the weights in moe_mma.pack's layout")
    p.add_argument("--grid", action="store_true",
                   help="also time one grid row of CTAs per expert (moe_mma.BALANCED off; key prefix grid:)")
    a = p.parse_args(argv)
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:  # (before: a KeyError at that shape, after the device time of the shapes before it)
        p.error(f"--shapes {a.shapes!r}: {unknown} not among {', '.join(SHAPES)}")
    variants = [tuple(v for v in var.split("+") if v) for var in a.variants.split(",")]
    for var in variants:  # (refused before any GPU work; the kernel build refuses them too)
        try:
            moe_mma.check_defines(var, moe_mma.SOURCE.read_text())
        except ValueError as e:
            p.error(f"--variants {a.variants!r}: {e}")
    bw = copy_bandwidth()
    rows = []
    for name in a.shapes.split(","):
        e, k, n = SHAPES[name]
        torch.manual_seed(0)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = fused.quantize(w, Quantizer(a.fmt), check_finite=False)[0]
        wbytes = wq.codes.numel() + wq.block_scales.numel()
        layouts = {"": wq, "packed:": moe_mma.pack(wq)} if a.packed else {"": wq}
        bf16 = bf16_baseline(w)[0]
        for tpe in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(tpe * e, k, device="cuda", dtype=torch.bfloat16)
            offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * tpe
            ref = (grouped_mm_reference(x, wq, offs, out_dtype=torch.float32) if e * n * k <= 2**31
                   else moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32))  # (DeepSeek-V3: too big)
            row = {"shape": name, "E_K_N": [e, k, n], "tok_per_expert": tpe, "fmt": a.fmt,
                   "bf16_us": round(graph_ms(lambda x=x, offs=offs, f=bf16: f(x, offs)) * 1e3, 1),
                   "triton_us": round(graph_ms(lambda x=x, offs=offs, wq=wq: moe_triton.grouped_mm(x, wq, offs))
                                      * 1e3, 1)}
            splits = (True, False) if a.grid else (True,)
            for (prefix, wl), var, bal in [(lw, v, b) for lw in layouts.items() for v in variants for b in splits]:
                moe_mma.DEFINES, moe_mma.BALANCED = var, bal
                us = graph_ms(lambda x=x, offs=offs, wl=wl: moe_mma.grouped_mm(x, wl, offs)) * 1e3
                y = moe_mma.grouped_mm(x, wl, offs, out_dtype=torch.float32)
                moe_mma.BALANCED = True
                tag = ("" if bal else "grid:") + prefix + ("+".join(var) or "default")
                row[tag] = {"us": round(us, 1), "weight_frac_copy": round(wbytes / (us * 1e-6) / bw, 3),
                            "speedup_vs_bf16": round(row["bf16_us"] / us, 2),
                            "rel_err": float(f"{float((y - ref).norm() / ref.norm()):.2e}")}
            moe_mma.DEFINES = ()
            row["triton_weight_frac_copy"] = round(wbytes / (row["triton_us"] * 1e-6) / bw, 3)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    res = {"bench": "moe_mma", "copy_TBps": round(bw / 1e12, 3), "machine": machine(), "results": rows}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
