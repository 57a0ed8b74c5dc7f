"""FP4-weight grouped GEMMs (Triton and CUDA, W4A16) vs bf16 ``torch._grouped_mm`` at MoE decode shapes.

All experts get the same number of tokens (1..256). Prints one JSON line: per shape and tokens per
expert, the bf16 time, the best FP4 time over the candidate configs (and which), the speedup, and
the weight-read rate as a fraction of the copy bandwidth measured in the same run, and the default config on the
full grid (``fp4_default_full_grid_us``: a program per (column tile, expert), the launch before session 15); where it
runs, the CUDA kernel too (``moe_mma``, session 24: ``mma_us``, ``mma_speedup``, ``mma_weight_frac_copy``). Usage:
    python benchmarks/bench_moe_gemm.py [--shapes qwen3_fc1,qwen3_fc2,dsv3_fc1] [--tokens 1,4,16,64,256]
    python benchmarks/bench_moe_gemm.py --sweep   # launch-config grid: one JSON line per (shape, tpe, config),
                                                  # then the best config per (shape, tpe) (< 150 s on one H200)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

import torch
from _timing import copy_bandwidth, graph_ms, machine, median_ms

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import dequant_triton, fused, moe_mma, moe_triton

SHAPES = {  # name: (experts, K, N) as in torch._grouped_mm's mat_b [E, K, N]
    "qwen3_fc1": (128, 2048, 1536),
    "qwen3_fc2": (128, 768, 2048),
    "dsv3_fc1": (256, 7168, 4096),
    "dsv3_fc2": (256, 2048, 7168),
}
SMALL = [(64, 256, 16, 4, 1), (64, 128, 16, 4, 3), (128, 128, 16, 8, 1), (128, 256, 16, 8, 1), (64, 256, 16, 4, 2)]
MID = [(64, 256, 32, 4, 1), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3)]
LARGE = [(128, 64, 128, 8, 3), (128, 128, 128, 8, 3), (128, 64, 256, 8, 3)]
# --sweep grid, (BN, BK, BT, num_warps, num_stages[, join_k[, max_registers]]) per tokens-per-expert bucket (PTX
# dequant): BT is the token tile, BN x BK the weight tile per K step, join_k one MMA chain over K-ordered weights
# (for large token tiles), max_registers a register cap (more programs per multiprocessor; the decode row's
# candidates from `python benchmarks/sass_moe_gemm.py`: 80-96 registers, at most 112 bytes spilled).
SWEEP = {
    16: [(128, 128, 16, 4, 4), (128, 128, 16, 2, 4), (128, 128, 16, 2, 3), (64, 128, 16, 2, 4), (64, 128, 16, 2, 3),
         (64, 128, 16, 1, 4), (64, 256, 16, 2, 3), (128, 128, 16, 4, 3, 0, 96)],
    64: [(128, 128, 64, 4, 3), (128, 128, 64, 4, 3, True), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4)],
    1 << 30: [(128, 64, 256, 8, 3, True), (128, 64, 256, 8, 3), (128, 128, 128, 8, 3, True), (128, 128, 128, 8, 3),
              (256, 64, 128, 8, 3, True)],
}
"""The 16 row's 1- and 2-warp configs compile to mma.sync (HMMA) instead of wgmma, with no warpgroup waits; they
were no faster (BENCHMARKS.md, session 10)."""


def candidates(tpe: int):
    c = []
    if tpe <= 32:
        c += SMALL
    if 8 <= tpe <= 128:
        c += MID
    if tpe >= 64:
        c += LARGE
    return c


def bf16_baseline(w_nk):
    """(fn(x, offs), layout): torch._grouped_mm with mat_b [E, K, N], a transposed view of w [E, N, K] if accepted."""
    e, _, k = w_nk.shape
    x = torch.randn(e, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32)
    try:
        torch._grouped_mm(x, w_nk.transpose(-2, -1), offs=offs)
        return (lambda xx, oo: torch._grouped_mm(xx, w_nk.transpose(-2, -1), offs=oo)), "mat_b K-contiguous view"
    except RuntimeError:
        w_kn = w_nk.transpose(-2, -1).contiguous()
        return (lambda xx, oo: torch._grouped_mm(xx, w_kn, offs=oo)), "mat_b N-contiguous"


TIMER = {"graph": lambda fn: graph_ms(fn, calls=10, reps=5), "events": lambda fn: median_ms(fn, reps=30)}
"""--timer: device time per call (CUDA graph of 10 calls, L2 flushed before each; default) or CUDA events around
each eager call (sessions 2-8: includes the host's launch when the GPU waits for it)."""
_time = TIMER["graph"]


def run_shape(name, e, k, n, tokens, bw, fmts, sweep):
    torch.manual_seed(0)
    w = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02)  # [E, N, K]
    quant = {f: fused.quantize(w, Quantizer(f), check_finite=False)[0] for f in fmts}
    bf16_grouped, layout = bf16_baseline(w)
    deq_mm = {f: bf16_baseline(dequant_triton.dequantize(wq, torch.bfloat16))[0] for f, wq in quant.items()}
    rows = []
    for tpe in tokens:
        t = tpe * e
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * tpe
        ms_bf16 = _time(lambda x=x, offs=offs: bf16_grouped(x, offs))
        for fmt, wq in quant.items():
            wbytes = wq.codes.numel() + wq.block_scales.numel()
            default, default_asm = moe_triton.default_config(t, e, k)
            cands = [default] + [c for c in (candidates(tpe) if sweep and fmt == "nvfp4" else []) if c != default]
            timings = {}
            for cfg in cands:
                for asm in (False, True):
                    timings[str(cfg) + ("-ptx" if asm else "")] = _time(
                        lambda c=cfg, a=asm, x=x, wq=wq, offs=offs: moe_triton.grouped_mm(x, wq, offs, config=c,
                                                                                      deq_asm=a))
            full_grid_ms = _time(lambda x=x, wq=wq, offs=offs: moe_triton.grouped_mm(x, wq, offs, k_slices=1,
                                                                                     programs=0))
            default = str(default) + ("-ptx" if default_asm else "")
            best = min(timings, key=timings.get)
            ms = timings[best]
            y = moe_triton.grouped_mm(x, wq, offs)
            ref = deq_mm[fmt](x, offs)
            rel = float((y.float() - ref.float()).norm() / ref.float().norm())
            row = {"shape": name, "E_K_N": [e, k, n], "tok_per_expert": tpe, "fmt": fmt, "bf16_layout": layout,
                   "bf16_us": round(ms_bf16 * 1e3, 1), "fp4_us": round(ms * 1e3, 1),
                   "fp4_default_us": round(timings[default] * 1e3, 1), "best_config": best,
                   "fp4_default_full_grid_us": round(full_grid_ms * 1e3, 1),
                   "speedup": round(ms_bf16 / ms, 2), "speedup_default": round(ms_bf16 / timings[default], 2),
                   "fp4_weight_frac_copy": round(wbytes / (ms * 1e-3) / bw, 3),
                   "bf16_weight_frac_copy": round(2 * w.numel() / (ms_bf16 * 1e-3) / bw, 3),
                   "rel_err_vs_bf16_dequant": round(rel, 5),
                   "all_us": {kk: round(v * 1e3, 1) for kk, v in timings.items()}}
            if moe_mma.unsupported(x, wq) is None:  # the CUDA (mma.sync) kernel
                ms_mma = _time(lambda x=x, wq=wq, offs=offs: moe_mma.grouped_mm(x, wq, offs))
                y = moe_mma.grouped_mm(x, wq, offs)
                row.update(mma_us=round(ms_mma * 1e3, 1), mma_speedup=round(ms_bf16 / ms_mma, 2),
                           mma_weight_frac_copy=round(wbytes / (ms_mma * 1e-3) / bw, 3),
                           mma_rel_err_vs_bf16_dequant=round(float((y.float() - ref.float()).norm()
                                                                   / ref.float().norm()), 5))
                print(f"{name:10s} tpe={tpe:4d} {fmt}: mma {row['mma_us']:8.1f} us x{row['mma_speedup']:5.2f} "
                      f"w-read {row['mma_weight_frac_copy']:.2f} of copy err {row['mma_rel_err_vs_bf16_dequant']:.1e}",
                      file=sys.stderr)
            rows.append(row)
            print(f"{name:10s} tpe={tpe:4d} {fmt}: bf16 {row['bf16_us']:8.1f} us  fp4 {row['fp4_us']:8.1f} us "
                  f"(default {row['fp4_default_us']:8.1f})  x{row['speedup']:5.2f}  "
                  f"fp4 w-read {row['fp4_weight_frac_copy']:.2f} of copy  best {best}  err {rel:.1e}",
                  file=sys.stderr)
    return rows


def sweep_configs(tpe: int):
    """The --sweep grid row for ``tpe`` tokens per expert."""
    return next(v for limit, v in SWEEP.items() if tpe <= limit)


def _precompile(job) -> str:
    """Compile one (shape, tokens, config) into Triton's on-disk cache (worker process; nothing is launched)."""
    e, k, n, tpe, fmt, cfg = job
    bs = 16 if fmt == "nvfp4" else 32
    g = torch.empty((), device="cuda") if fmt == "nvfp4" else None
    w = SimpleNamespace(shape=(e, n, k), fmt=fmt, block_size=bs, global_amax=g)
    scales = torch.empty(0, dtype=torch.uint8, device="cuda")
    ptrs = (torch.empty(0, dtype=torch.bfloat16, device="cuda"), torch.empty(0, dtype=torch.uint16, device="cuda"),
            scales, scales if g is None else g, torch.empty(0, dtype=torch.bfloat16, device="cuda"),
            torch.empty(0, dtype=torch.int32, device="cuda"))
    try:
        scalars, grid, meta = moe_triton.launch_spec(tpe * e, w, cfg, True, k, n)
        moe_triton.fp4_gemm_kernel.warmup(*ptrs, *scalars, grid=grid, **meta)
        return ""
    except Exception as exc:  # reported; the timed launch then compiles (or fails) itself
        return f"{cfg}: {exc}"[:200]


def precompile(jobs, workers: int) -> None:
    """Compile the sweep's kernels in parallel processes (they share Triton's disk cache with this one)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for err in pool.map(_precompile, jobs):
            if err:
                print(f"precompile failed: {err}", file=sys.stderr)


def sweep_shape(name, e, k, n, tokens, bw, fmt="nvfp4"):
    """Time every --sweep config at each tokens-per-expert; print a JSON line each; return the best per tpe."""
    torch.manual_seed(0)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02  # [E, N, K]
    wq = fused.quantize(w, Quantizer(fmt), check_finite=False)[0]
    wbytes = wq.codes.numel() + wq.block_scales.numel()
    bf16_grouped, _ = bf16_baseline(w)
    best = {}
    for tpe in tokens:
        x = torch.randn(tpe * e, k, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * tpe
        ms_bf16 = _time(lambda x=x, offs=offs: bf16_grouped(x, offs))
        ref = moe_triton.grouped_mm(x, wq, offs).float()  # the default config: each row's error against it
        for cfg in sweep_configs(tpe):
            try:
                ms = _time(lambda c=cfg, x=x, offs=offs: moe_triton.grouped_mm(x, wq, offs, config=c))
                err = ((moe_triton.grouped_mm(x, wq, offs, config=cfg).float() - ref).norm() / ref.norm()).item()
            except Exception as exc:  # a config that does not fit (shared memory, registers): report, go on
                print(json.dumps({"shape": name, "tok_per_expert": tpe, "config": list(cfg), "error": str(exc)[:200]}))
                continue
            row = {"shape": name, "E_K_N": [e, k, n], "tok_per_expert": tpe, "fmt": fmt, "config": list(cfg),
                   "time_us": round(ms * 1e3, 1), "bf16_us": round(ms_bf16 * 1e3, 1),
                   "speedup": round(ms_bf16 / ms, 2), "fp4_weight_frac_copy": round(wbytes / (ms * 1e-3) / bw, 3),
                   "rel_err_vs_default": float(f"{err:.2e}")}
            print(json.dumps(row), flush=True)
            if tpe not in best or row["time_us"] < best[tpe]["time_us"]:
                best[tpe] = row
    return best


def main_sweep(args, bw) -> dict:
    """--sweep: the config grid; the last JSON line holds the best config per (shape, tokens per expert)."""
    tokens = [int(v) for v in args.sweep_tokens.split(",")]
    jobs = [(*SHAPES[name], tpe, "nvfp4", cfg) for name in args.shapes.split(",") for tpe in tokens
            for cfg in sweep_configs(tpe)]
    if args.compile_workers > 0:
        precompile(jobs, args.compile_workers)
    best = {}
    for name in args.shapes.split(","):
        e, k, n = SHAPES[name]
        best[name] = sweep_shape(name, e, k, n, tokens, bw)
        torch.cuda.empty_cache()
    res = {"bench": "moe_gemm_sweep", "copy_TBps": round(bw / 1e12, 3), "machine": machine(), "timer": args.timer,
           "best": {name: {str(t): {kk: r[kk] for kk in ("config", "time_us", "speedup", "fp4_weight_frac_copy")}
                           for t, r in rows.items()} for name, rows in best.items()}}
    print(json.dumps(res))
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_fc1,qwen3_fc2,dsv3_fc1")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--big-tokens", default="1,4,16,64,256", help="tokens per expert for the dsv3 shapes")
    p.add_argument("--fmts", default="nvfp4,mxfp4")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--sweep", action="store_true", help="time the launch-config grid (SWEEP) instead")
    p.add_argument("--sweep-tokens", default="1,4,16,64,256")
    p.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="processes compiling the --sweep kernels up front (0: compile on first launch)")
    p.add_argument("--timer", choices=sorted(TIMER), default="graph")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:  # (before: a KeyError at that shape, after the device time of the shapes before it)
        p.error(f"--shapes {args.shapes!r}: {unknown} not among {', '.join(SHAPES)}")
    global _time
    _time = TIMER[args.timer]
    bw = copy_bandwidth()
    if args.sweep:
        return main_sweep(args, bw)
    tokens = [int(v) for v in args.tokens.split(",")]
    rows = []
    for name in args.shapes.split(","):
        e, k, n = SHAPES[name]
        big = name.startswith("dsv3")
        fmts = ["nvfp4"] if big else args.fmts.split(",")
        toks = [int(v) for v in args.big_tokens.split(",")] if big else tokens
        rows += run_shape(name, e, k, n, toks, bw, fmts, not args.no_sweep)
        torch.cuda.empty_cache()
    res = {"bench": "moe_gemm", "copy_TBps": round(bw / 1e12, 3), "machine": machine(), "timer": args.timer,
           "results": rows}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
