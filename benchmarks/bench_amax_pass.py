"""Where the NVFP4 per-tensor quantize's time goes, and two ways to cut its amax pass (one GPU).

The per-tensor quantize reads x twice: ``quant_triton.absmax_kernel`` (a partial max per 8192 elements), a torch
max over the partials, then the quantize pass. This times each part alone and the whole under variants:

- ``evict_last``: the amax pass loads x with the L2 "evict last" hint, so that more of x is still in L2 when the
  quantize pass reads it again;
- ``atomic``: the amax pass folds its partials into one fp32 with an atomic max (a zeroed scalar first), instead
  of writing partials that a torch reduction reads (one launch fewer).

Prints one JSON line (device us from CUDA graphs after an L2 flush, ``_timing.graph_ms``; fraction of the copy
bandwidth measured in the same run), with a torch copy of x as the same-size ceiling. ``--flush-by both`` times
each op after a flush by writing (the benchmarks' protocol: L2 left dirty) and by reading (L2 left clean).
``--sweep`` times the amax pass alone over ``ABSMAX_BLOCK`` x ``ABSMAX_WARPS`` instead.
Usage: python benchmarks/bench_amax_pass.py [--rows 8192] [--k 2048] [--flush-by write|read|both] [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton
import triton.language as tl
from _timing import copy_bandwidth, graph_ms, machine
from bench_quant import with_settings

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fused, quant_triton


@triton.jit
def _amax_variant(x_ptr, n, out_ptr, BLOCK: tl.constexpr, EVICT: tl.constexpr, ATOMIC: tl.constexpr):
    """``absmax_kernel`` (last block first) with an eviction hint, and an atomic max into out[0] if ATOMIC."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy=EVICT).to(tl.float32)
    m = tl.max(tl.abs(x), axis=0)
    if ATOMIC:
        tl.atomic_max(out_ptr, m)
    else:
        tl.store(out_ptr + pid, m)


def _amax_config(block: int, warps: int, fn):
    """fn() with the amax pass's ``quant_triton`` constants set (restored after)."""
    return with_settings({"ABSMAX_BLOCK": block, "ABSMAX_WARPS": warps}, fn)


def sweep(x) -> list[dict]:
    """The amax pass (``absmax()``: the kernel + a torch max) over its launch choices, best first."""
    rows = []
    want = quant_triton.absmax(x, None)
    for block in (2048, 4096, 8192, 16384):
        for warps in (2, 4, 8, 16):
            if block // (32 * warps) < 8:  # (under 8 elements a thread: not a streaming load)
                continue

            def fn(block=block, warps=warps):
                return _amax_config(block, warps, lambda: quant_triton.absmax(x, None))
            if not torch.equal(fn(), want):
                raise SystemExit(f"amax pass {block, warps} differs")
            us = graph_ms(fn) * 1e3
            rows.append({"block": block, "warps": warps, "graph_us": round(us, 1)})
    rows.sort(key=lambda r: r["graph_us"])
    return rows


def _variant(evict: str, atomic: bool):
    """An ``absmax(x2d, err)`` replacement (no NaN count: the benchmark's x is finite)."""
    block = quant_triton.ABSMAX_BLOCK

    def absmax(x2d, err):
        n = x2d.numel()
        grid = (triton.cdiv(n, block),)
        if atomic:
            out = torch.zeros(1, dtype=torch.float32, device=x2d.device)
            _amax_variant[grid](x2d, n, out, BLOCK=block, EVICT=evict, ATOMIC=True, num_warps=8)
            return out[0]
        parts = torch.empty(grid[0], dtype=torch.float32, device=x2d.device)
        _amax_variant[grid](x2d, n, parts, BLOCK=block, EVICT=evict, ATOMIC=False, num_warps=8)
        return parts.amax()

    return absmax


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--sweep", action="store_true",
                   help="time the amax pass's launch choices (elements per program, warps)")
    p.add_argument("--flush-by", choices=("write", "read", "both"), default="write",
                   help="how the L2 is flushed before each call (_timing.graph_ms); both: each op both ways")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.k, device="cuda").to(torch.bfloat16)
    n = x.numel()
    q = Quantizer("nvfp4")
    bw = copy_bandwidth()
    whole = x.element_size() * n + n // 2 + n // 16
    g = quant_triton.absmax(x, None).reshape(1)
    parts = torch.empty(triton.cdiv(n, quant_triton.ABSMAX_BLOCK), device="cuda")
    ref = fused.quantize(x, q, check_finite=False)[0]

    def quant_pass():
        return quant_triton.run_quant(x, fmt=0, block=16, mode=quant_triton.RNE, g_mode=quant_triton.G_SCALAR, g=g)

    def full():
        return fused.quantize(x, q, check_finite=False)

    if args.sweep:
        res = {"bench": "amax_sweep", "shape": [args.rows, args.k], "machine": machine(), "results": sweep(x)}
        for r in res["results"][:8]:
            print(r, file=sys.stderr)
        print(json.dumps(res))
        return res
    ops = {  # name: (fn, bytes it must move)
        "amax kernel alone": (lambda: quant_triton.absmax_kernel[(parts.numel(),)](
            x, n, parts, g, BLOCK=quant_triton.ABSMAX_BLOCK, CHECK_FINITE=False,
            LAST_FIRST=quant_triton.ABSMAX_LAST_FIRST, num_warps=quant_triton.ABSMAX_WARPS), x.element_size() * n),
        "absmax() (kernel + torch max)": (lambda: quant_triton.absmax(x, None), x.element_size() * n),
        "quantize pass alone (amax given)": (quant_pass, whole),
        "per-tensor quantize (as shipped)": (full, whole),
    }
    ops["per-tensor quantize (amax: 8192 elements x 8 warps)"] = (
        lambda: _amax_config(8192, 8, full), whole)
    for evict in ("", "evict_last"):
        for atomic in (False, True):
            name = f"per-tensor quantize (evict={evict or 'none'}, atomic={atomic})"
            fn = functools.partial(with_settings, {"absmax": _variant(evict, atomic)}, full)
            t = fn()[0]
            same = torch.equal(t.codes, ref.codes) and torch.equal(t.block_scales.view(torch.uint8),
                                                                  ref.block_scales.view(torch.uint8))
            if not same or not torch.equal(t.global_amax, ref.global_amax):
                raise SystemExit(f"{name}: codes, scales or amax differ from the shipped path")
            ops[name] = (fn, whole)
    y = torch.empty_like(x)
    ops["copy of x (torch)"] = (lambda: y.copy_(x), 2 * x.element_size() * n)
    rows = []
    for name, (fn, nbytes) in ops.items():
        for flush_by in (("write", "read") if args.flush_by == "both" else (args.flush_by,)):
            us = graph_ms(fn, flush_by=flush_by) * 1e3
            rows.append({"op": name, "flush_by": flush_by, "graph_us": round(us, 1), "bytes": nbytes,
                         "graph_frac_copy": round(nbytes / (us * 1e-6) / bw, 3)})
            print(f"{name:60s} {flush_by:5s} {us:8.1f} us {rows[-1]['graph_frac_copy']:.3f} of copy",
                  file=sys.stderr)
    res = {"bench": "amax_pass", "shape": [args.rows, args.k], "dtype": "bf16", "copy_TBps": round(bw / 1e12, 3),
           "machine": machine(), "results": rows}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
