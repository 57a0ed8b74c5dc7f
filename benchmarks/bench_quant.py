"""Bandwidth of the Triton quantize / guided / fake-quant / dequantize kernels on one GPU.

Prints one JSON line: the copy ceiling and, per op, the median time, the bytes it must move and
that rate as a fraction of the copy bandwidth (METRICS.md protocol). Usage:
    python benchmarks/bench_quant.py [--rows 32768] [--k 2048]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _timing import copy_bandwidth, machine, median_ms

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import dequant_triton, fused


def cases(x, rows, k):
    q_row, q_ten = Quantizer("nvfp4", per_row=True), Quantizer("nvfp4")
    q_mx = Quantizer("mxfp4", scale_rule="ceil")
    n = rows * k
    xb = x.element_size() * n
    t_row, rec, _ = fused.quantize(x, q_row, record=True)
    t_mx = fused.quantize(x, q_mx)[0]
    full = t_row.guidance(compact=False)
    rec_b = n // 8 + n // 16 + 4 * rows  # bits + scales + amax
    out = {  # name: (fn, bytes moved at least)
        "quantize_nvfp4_row+record": (lambda: fused.quantize(x, q_row, record=True, check_finite=False),
                                      xb + n // 2 + rec_b),
        "quantize_nvfp4_row+record_checked": (lambda: fused.quantize(x, q_row, record=True), xb + n // 2 + rec_b),
        "quantize_nvfp4_tensor(2 passes)": (lambda: fused.quantize(x, q_ten, check_finite=False),
                                            xb + n // 2 + n // 16),
        "quantize_mxfp4_ceil": (lambda: fused.quantize(x, q_mx, check_finite=False), xb + n // 2 + n // 32),
        "guided_compact+dequant(fake-quant fwd)": (
            lambda: fused.guided(x, rec, write_codes=False, deq_dtype=x.dtype, check_finite=False), 2 * xb + rec_b),
        "guided_full+dequant": (
            lambda: fused.guided(x, full, write_codes=False, deq_dtype=x.dtype, check_finite=False),
            2 * xb + n // 2 + n // 16 + 4 * rows),
        "guided_compact->codes": (lambda: fused.guided(x, rec, check_finite=False), xb + rec_b + n // 2),
        "fake_quant_rne+ste_mask": (
            lambda: fused.quantize(x, Quantizer("nvfp4", per_row=True, ste_clip=True), write_codes=False,
                                   deq_dtype=x.dtype, want_mask=True, check_finite=False), 3 * xb),
        "dequantize_nvfp4->bf16": (lambda: dequant_triton.dequantize(t_row, torch.bfloat16), n // 2 + n // 16 + xb),
        "dequantize_mxfp4->bf16": (lambda: dequant_triton.dequantize(t_mx, torch.bfloat16), n // 2 + n // 32 + xb),
        "compact_from_codes": (lambda: dequant_triton.compact(t_row), n // 2 + n // 8),
        "reference_torch_cuda_quantize_nvfp4_row": (lambda: q_row.quantize(x), xb + n // 2 + n // 16),
    }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--k", type=int, default=2048)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.k, device="cuda").to(torch.bfloat16)
    bw = copy_bandwidth()
    rows = []
    for name, (fn, nbytes) in cases(x, args.rows, args.k).items():
        ms = median_ms(fn, reps=10 if name.startswith("reference") else 30)
        rate = nbytes / (ms * 1e-3)
        rows.append({"op": name, "ms": round(ms, 4), "bytes": nbytes, "TBps": round(rate / 1e12, 3),
                     "frac_copy": round(rate / bw, 3)})
        print(f"{name:45s} {ms * 1e3:9.1f} us  {rate / 1e12:6.2f} TB/s  {rate / bw:5.2f} of copy", file=sys.stderr)
    res = {"bench": "quant", "shape": [args.rows, args.k], "dtype": "bf16", "copy_TBps": round(bw / 1e12, 3),
           "machine": machine(), "results": rows}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
