"""The wgmma FP4 grouped GEMM (``kernels/moe_wgmma``) at prefill sizes against bf16 ``torch._grouped_mm`` and the
Triton kernel.

All experts get the same number of tokens. Per shape and tokens per expert: device time per call (CUDA graphs, the L2
flushed before each call), TFLOP/s, the speedup against bf16, and the error against the fp32 reference (DeepSeek-V3's
shape: against the Triton kernel's fp32 output). Variants are ``moe_wgmma.DEFINES`` macro sets (``XS=5``: five token
stages; ``SKIP_DEQUANT=1``: no dequantization, wrong numbers, the time of everything else). ``--grids persistent,items``
also times one CTA per 128-row x expert item (keys ``.../items``) beside the persistent grid. Prints one JSON line.
Usage:
    python benchmarks/bench_moe_wgmma.py [--shapes qwen3_fc1,qwen3_fc2] [--tokens 64,128,256] [--fmt nvfp4]
        [--tiles 128,256] [--variants ,SKIP_DEQUANT=1] [--grids persistent,items]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _timing import graph_ms, machine
from bench_moe_gemm import SHAPES, bf16_baseline

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fused, grouped_mm_reference, moe_mma, moe_triton, moe_wgmma


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3_fc1,qwen3_fc2")
    p.add_argument("--tokens", default="64,128,256")
    p.add_argument("--fmt", default="nvfp4")
    p.add_argument("--tiles", default="128,256")
    p.add_argument("--variants", default="", help="comma-separated; each a '+'-joined list of NAME=value macros")
    p.add_argument("--grids", default="persistent", help="persistent and/or items (one CTA per item)")
    p.add_argument("--no-triton", action="store_true")
    a = p.parse_args(argv)
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:  # (before: a KeyError at that shape, after the device time of the shapes before it)
        p.error(f"--shapes {a.shapes!r}: {unknown} not among {', '.join(SHAPES)}")
    variants = [tuple(v for v in var.split("+") if v) for var in a.variants.split(",")]
    for var in variants:  # (refused before any GPU work; the kernel build refuses them too)
        try:
            moe_mma.check_defines(var, moe_mma.SOURCE.read_text() + "\n" + moe_wgmma.SOURCE.read_text())
        except ValueError as e:
            p.error(f"--variants {a.variants!r}: {e}")
    rows = []
    for name in a.shapes.split(","):
        e, k, n = SHAPES[name]
        torch.manual_seed(0)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = fused.quantize(w, Quantizer(a.fmt), check_finite=False)[0]
        packed = moe_wgmma.pack(wq)
        bf16 = bf16_baseline(w)[0]
        for tpe in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(tpe * e, k, device="cuda", dtype=torch.bfloat16)
            offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * tpe
            big = e * n * k > 2**31 or tpe * e * n > 2**28
            ref = (moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32) if big
                   else grouped_mm_reference(x, wq, offs, out_dtype=torch.float32))
            flop = 2.0 * tpe * e * n * k
            bf16_us = graph_ms(lambda x=x, offs=offs, f=bf16: f(x, offs)) * 1e3
            row = {"shape": name, "E_K_N": [e, k, n], "tok_per_expert": tpe, "fmt": a.fmt,
                   "bf16_us": round(bf16_us, 1), "bf16_tflops": round(flop / bf16_us / 1e6, 1)}
            if not a.no_triton:
                us = graph_ms(lambda x=x, offs=offs, wq=wq: moe_triton.grouped_mm(x, wq, offs)) * 1e3
                row["triton"] = {"us": round(us, 1), "speedup_vs_bf16": round(bf16_us / us, 3)}
            for var, grid, bt in [(v, g, int(t)) for v in variants for g in a.grids.split(",")
                                  for t in a.tiles.split(",")]:
                moe_wgmma.DEFINES = var
                moe_wgmma.PERSISTENT = grid == "persistent"
                us = graph_ms(lambda x=x, offs=offs, bt=bt, p=packed: moe_wgmma.grouped_mm(x, p, offs, bt=bt))
                us *= 1e3
                y = moe_wgmma.grouped_mm(x, packed, offs, out_dtype=torch.float32, bt=bt)
                err = float((y - ref).norm() / ref.norm())
                key = f"wgmma{bt}:{'+'.join(var) or 'default'}" + ("" if moe_wgmma.PERSISTENT else "/items")
                row[key] = {
                    "us": round(us, 1), "tflops": round(flop / us / 1e6, 1),
                    "speedup_vs_bf16": round(bf16_us / us, 3), "rel_err": float(f"{err:.2e}")}
                del y
            moe_wgmma.DEFINES, moe_wgmma.PERSISTENT = (), True
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
            del x, ref
            torch.cuda.empty_cache()
    res = {"bench": "moe_wgmma", "machine": machine(), "results": rows}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
