"""The memory ceilings of the FP4 kernels' traffic shapes on the GPU, against the copy the goals are stated in.

The issue's goal for the quantize and dequantize kernels is a fraction of the measured copy bandwidth (read +
write bytes of a device copy, ``_timing.copy_bandwidth``). Their traffic is not a copy's: dequantizing NVFP4 to
bf16 reads 0.56 bytes and writes 2 per element, quantizing reads 2 and writes 0.69. Five trivial Triton kernels
move the same byte mixes with no arithmetic to speak of, so their rates are what any kernel of that shape can
reach on this machine:

- ``copy``: int32 in, int32 out (1 : 1);
- ``expand``: uint8 in, int32 out (1 : 4; dequantize is 1 : 3.6);
- ``shrink``: int32 in, uint8 out (4 : 1; quantize is 2.9 : 1);
- ``read``: int32 in, one int32 per program out;
- ``write``: a constant int32 out.

Each runs over a sweep of (elements per program, warps) and reports the best device time (``_timing.graph_ms``,
L2 flushed before each call). ``python3 benchmarks/bench_bandwidth.py [--mib 256]`` prints one JSON row per
shape (bytes moved, the best config, TB/s, fraction of copy) and a summary row.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from _timing import copy_bandwidth, graph_ms, machine

CONFIGS = [(1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8)]
"""(elements per program, num_warps) tried for every shape."""


@triton.jit
def _move(src_ptr, dst_ptr, n, SHAPE: tl.constexpr, BLOCK: tl.constexpr):
    """One program's BLOCK elements of the shape (0 copy, 1 expand, 2 shrink, 3 read, 4 write)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SHAPE == 4:
        tl.store(dst_ptr + offs, tl.full([BLOCK], 7, tl.int32), mask=mask)
    else:
        v = tl.load(src_ptr + offs, mask=mask, other=0)
        if SHAPE == 3:
            tl.store(dst_ptr + tl.program_id(0), tl.sum(v.to(tl.int32), axis=0))
        else:
            tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=mask)


SHAPES = {  # name -> (SHAPE id, source dtype, destination dtype or None: one int32 per program)
    "copy": (0, torch.int32, torch.int32), "expand": (1, torch.uint8, torch.int32),
    "shrink": (2, torch.int32, torch.uint8), "read": (3, torch.int32, None), "write": (4, None, torch.int32),
}


def time_shape(name: str, n: int) -> dict:
    """The best (device us, config) of ``name`` over CONFIGS for n elements."""
    sid, sdt, ddt = SHAPES[name]
    src = torch.randint(0, 100, (n,), device="cuda", dtype=torch.int32).to(sdt) if sdt is not None else None
    best = None
    for block, warps in CONFIGS:
        grid = (triton.cdiv(n, block),)
        dst = torch.empty(n if ddt is not None else grid[0], device="cuda", dtype=ddt or torch.int32)
        s = src if src is not None else dst

        def fn(grid=grid, s=s, dst=dst, block=block, warps=warps):
            _move[grid](s, dst, n, SHAPE=sid, BLOCK=block, num_warps=warps)

        us = graph_ms(fn) * 1e3
        if best is None or us < best[0]:
            best = (us, block, warps)
    nbytes = n * ((sdt.itemsize if sdt is not None else 0) + (ddt.itemsize if ddt is not None else 0))
    return {"shape": name, "elements": n, "bytes": nbytes, "us": round(best[0], 1), "block": best[1],
            "num_warps": best[2], "TBps": round(nbytes / (best[0] * 1e-6) / 1e12, 3)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256, help="size of the int32 side of each shape, MiB")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args(argv)
    n = (a.mib << 20) // 4
    bw = copy_bandwidth()
    rows = []
    for name in a.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}; valid: {', '.join(SHAPES)}")
        row = time_shape(name, n)
        row["frac_copy"] = round(row["TBps"] * 1e12 / bw, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"bench": "bandwidth", "copy_TBps": round(bw / 1e12, 3), "machine": machine(),
                      "frac_copy": {r["shape"]: r["frac_copy"] for r in rows}}), flush=True)
    print("bandwidth: " + ", ".join(f"{r['shape']} {r['TBps']} TB/s ({r['frac_copy']} of copy)" for r in rows),
          file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
