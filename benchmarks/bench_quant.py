"""Bandwidth of the Triton quantize / guided / fake-quant / dequantize kernels on one GPU.

Prints one JSON line: the copy ceiling and, per op, the median time, the bytes it must move and
that rate as a fraction of the copy bandwidth (METRICS.md protocol), and the same from the op captured in a
CUDA graph (``graph_us``: device time alone, where launching costs more than the kernel). Usage:
    python benchmarks/bench_quant.py [--rows 32768] [--k 2048] [--sweep] [--ops NAME,...] [--set ENTRY.KEY=INT]

``--sweep`` times the kernel ops over launch configs (``quant_triton.CONFIG``: elements per program tile and
num_warps; ``--elem`` adds the element-wise kernels, ``PAIR_KERNEL`` off), one JSON line per (op, config), then
the best config per op. Set the winners in ``quant_triton.CONFIG`` ("pair" for NVFP4 quantize ops, "pair_guided"
for NVFP4 guided compact, "pair_fake" for NVFP4 RNE fake-quant, "pair_mxfp4", "dequant", "dequant_mxfp4").
``--set`` changes one CONFIG value (e.g. ``pair_guided.programs_per_sm=5``: a prefetching grid) for a plain run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _timing import copy_bandwidth, graph_ms, machine, median_ms

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import dequant_triton, fused, ops, quant_triton
from megatron_trace.kernels.checks import FiniteCounter

SWEEP = [dict(pair=True, tile=t, num_warps=nw) for t, nw in ((4096, 4), (4096, 8), (2048, 4), (2048, 2), (8192, 8),
                                                            (16384, 8))]
"""Launch configs of the word-pair kernels (``quant_triton.CONFIG``'s PAIR_ENTRIES and DEQUANT_ENTRIES)."""
PAIR_ENTRIES = ("pair", "pair_guided", "pair_fake", "pair_mxfp4")
DEQUANT_ENTRIES = ("dequant", "dequant_mxfp4")
ELEM_SWEEP = [dict(pair=False, tile=t, num_warps=nw) for t, nw in ((4096, 4), (8192, 8))]
SWEEP_BUDGET_S = 110.0
"""The sweep stops starting new configs after this many seconds (each config recompiles every kernel)."""
"""``--elem``: the element-wise kernels (``PAIR_KERNEL`` off; CONFIG "elem"), for comparison."""


_BY_MAGNITUDE = ("RNE_BY_MAGNITUDE", "GUIDED_BY_MAGNITUDE", "DEQUANT_BY_MAGNITUDE")


def with_settings(values: dict, fn):
    """fn() with the ``quant_triton`` constants ``values`` (name: value) set (restored after)."""
    saved = {name: getattr(quant_triton, name) for name in values}
    for name, v in values.items():
        setattr(quant_triton, name, v)
    try:
        return fn()
    finally:
        for name, v in saved.items():
            setattr(quant_triton, name, v)


def _flags_off(names, fn):
    """fn() with the ``quant_triton`` flags ``names`` False (restored after)."""
    return with_settings(dict.fromkeys(names, False), fn)


def _index_path(fn):
    """fn() with the pair kernels' E2M1-index tiles for RNE and guided compact NVFP4 and the per-element NVFP4
    dequantize (off: ``quant_triton.RNE_BY_MAGNITUDE``, ``GUIDED_BY_MAGNITUDE``, ``DEQUANT_BY_MAGNITUDE``), as
    before the tiles by fp32 magnitudes and the dequantize by per-block constants."""
    return _flags_off(_BY_MAGNITUDE, fn)


def _amax_first_first(fn):
    """fn() with the per-tensor amax pass reading x from its start (``quant_triton.ABSMAX_LAST_FIRST`` off), as
    before session 46: the quantize pass then finds x's last blocks in L2, not its first."""
    return _flags_off(("ABSMAX_LAST_FIRST",), fn)


def cases(x, rows, k):
    q_row, q_ten = Quantizer("nvfp4", per_row=True), Quantizer("nvfp4")
    q_mx = Quantizer("mxfp4", scale_rule="ceil")
    n = rows * k
    xb = x.element_size() * n
    t_row, rec, _ = fused.quantize(x, q_row, record=True)
    t_mx = fused.quantize(x, q_mx)[0]
    full = t_row.guidance(compact=False)
    rec_b = n // 8 + n // 16 + 4 * rows  # bits + scales + amax
    counter = FiniteCounter("bench")
    q_ste = Quantizer("nvfp4", per_row=True, ste_clip=True)

    def record_fn():
        return fused.quantize(x, q_row, record=True, check_finite=False)

    def fake_rne():
        return fused.quantize(x, q_ste, write_codes=False, deq_dtype=x.dtype, want_mask=True, check_finite=False)

    q_w = Quantizer("nvfp4", ste_clip=True)
    w = x.view(128 if rows % 128 == 0 else 1, -1, k)  # as 128 experts' stacked weights, each with its own amax

    def fake_stacked():  # (both with the step's deferred NaN/Inf counter: a checked given amax syncs the host)
        return fused.quantize(w, q_w, write_codes=False, deq_dtype=x.dtype, want_mask=True, check_finite=counter,
                              stacked=True)

    def fake_given():  # session 20's weights path: the experts' amaxes by torch ops, given per row
        amax = ops.abs_max(w, start_dim=1)[..., None, None]
        amax = torch.where(amax > 0, amax, 1.0).expand(*w.shape[:-1], 1)
        return fused.quantize(w, q_w, global_amax=amax, write_codes=False, deq_dtype=x.dtype, want_mask=True,
                              check_finite=counter)

    out = {  # name: (fn, bytes moved at least)
        "quantize_nvfp4_row+record": (record_fn, xb + n // 2 + rec_b),
        "quantize_nvfp4_row+record(index path)": (lambda: _index_path(record_fn), xb + n // 2 + rec_b),
        "quantize_nvfp4_row+record_checked": (lambda: fused.quantize(x, q_row, record=True), xb + n // 2 + rec_b),
        "quantize_nvfp4_row+record_deferred_check": (
            lambda: fused.quantize(x, q_row, record=True, check_finite=counter), xb + n // 2 + rec_b),
        "quantize_nvfp4_tensor(2 passes)": (lambda: fused.quantize(x, q_ten, check_finite=False),
                                            xb + n // 2 + n // 16),
        "quantize_nvfp4_tensor(2 passes, amax first-first)": (
            lambda: _amax_first_first(lambda: fused.quantize(x, q_ten, check_finite=False)), xb + n // 2 + n // 16),
        "quantize_mxfp4_ceil": (lambda: fused.quantize(x, q_mx, check_finite=False), xb + n // 2 + n // 32),
        "quantize_mxfp4_ceil(index path)": (lambda: _index_path(lambda: fused.quantize(x, q_mx, check_finite=False)),
                                            xb + n // 2 + n // 32),
        "guided_compact+dequant(fake-quant fwd)": (
            lambda: fused.guided(x, rec, write_codes=False, deq_dtype=x.dtype, check_finite=False), 2 * xb + rec_b),
        "guided_compact+dequant(index path)": (
            lambda: _index_path(lambda: fused.guided(x, rec, write_codes=False, deq_dtype=x.dtype,
                                                     check_finite=False)), 2 * xb + rec_b),
        "guided_full+dequant": (
            lambda: fused.guided(x, full, write_codes=False, deq_dtype=x.dtype, check_finite=False),
            2 * xb + n // 2 + n // 16 + 4 * rows),
        "guided_compact->codes": (lambda: fused.guided(x, rec, check_finite=False), xb + rec_b + n // 2),
        "fake_quant_rne+ste_mask": (fake_rne, 2 * xb + n),  # x in, x's dtype and a uint8 mask out
        "fake_quant_rne+ste_mask(index path)": (lambda: _index_path(fake_rne), 2 * xb + n),
        "fake_quant_stacked_weights(3 launches)": (fake_stacked, 2 * xb + n),  # (+ x read again by the amax pass)
        "fake_quant_given_amax_weights(session 20)": (fake_given, 2 * xb + n),
        "dequantize_nvfp4->bf16": (lambda: dequant_triton.dequantize(t_row, torch.bfloat16), n // 2 + n // 16 + xb),
        "dequantize_nvfp4->bf16(index path)": (
            lambda: _index_path(lambda: dequant_triton.dequantize(t_row, torch.bfloat16)), n // 2 + n // 16 + xb),
        "dequantize_mxfp4->bf16": (lambda: dequant_triton.dequantize(t_mx, torch.bfloat16), n // 2 + n // 32 + xb),
        "dequantize_mxfp4->bf16(index path)": (
            lambda: _index_path(lambda: dequant_triton.dequantize(t_mx, torch.bfloat16)), n // 2 + n // 32 + xb),
        "compact_from_codes": (lambda: dequant_triton.compact(t_row), n // 2 + n // 8),
        "reference_torch_cuda_quantize_nvfp4_row": (lambda: q_row.quantize(x), xb + n // 2 + n // 16),
    }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--sweep", action="store_true", help="time the launch configs instead")
    p.add_argument("--elem", action="store_true", help="with --sweep: also the element-wise kernels")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing (device time alone)")
    p.add_argument("--tile", type=int, default=0, help="the pair kernels' elements per program (quant_triton.CONFIG)")
    p.add_argument("--warps", type=int, default=0, help="the pair kernels' num_warps (with --tile)")
    p.add_argument("--dequant-max-registers", default="",
                   help="NVFP4[,MXFP4]: register caps of the bf16 dequantize kernel (0: none; quant_triton.CONFIG "
                        "'dequant', 'dequant_mxfp4')")
    p.add_argument("--pair-max-registers", type=int, default=0,
                   help="a register cap for guided compact rounding in the NVFP4 pair kernel (CONFIG['pair_guided'])")
    p.add_argument("--ops", default="", help="comma-separated substrings of the op names to time (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="ENTRY.KEY=INT",
                   help="a quant_triton.CONFIG value, e.g. pair_guided.programs_per_sm=6 (repeatable; 0 removes it)")
    args = p.parse_args(argv)
    if args.tile:
        for name in PAIR_ENTRIES:
            quant_triton.CONFIG[name] = {"tile": args.tile, "num_warps": args.warps or 4}
    for name, cap in zip(DEQUANT_ENTRIES, args.dequant_max_registers.split(",")):
        if cap:
            _set_config(f"{name}.max_registers={cap}")
    if args.pair_max_registers:
        _set_config(f"pair_guided.max_registers={args.pair_max_registers}")
    for item in args.set:  # (last: a --set value wins)
        _set_config(item)
    if args.sweep:
        return sweep(args.rows, args.k, SWEEP + (ELEM_SWEEP if args.elem else []),
                     tuple(o for o in args.ops.split(",") if o))
    only = tuple(o for o in args.ops.split(",") if o)
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.k, device="cuda").to(torch.bfloat16)
    bw = copy_bandwidth()
    rows = []
    ops = cases(x, args.rows, args.k)
    check_ops(only, list(ops))
    for name, (fn, nbytes) in ops.items():
        if only and not any(o in name for o in only):
            continue
        ms = median_ms(fn, reps=10 if name.startswith("reference") else 30)
        rate = nbytes / (ms * 1e-3)
        row = {"op": name, "ms": round(ms, 4), "bytes": nbytes, "TBps": round(rate / 1e12, 3),
               "frac_copy": round(rate / bw, 3)}
        if not name.startswith("reference") and not name.endswith("_checked") and not args.no_graph:
            gms = graph_ms(fn)  # the device time alone (a checked op's host sync cannot be captured)
            row.update(graph_us=round(gms * 1e3, 1), graph_frac_copy=round(nbytes / (gms * 1e-3) / bw, 3))
        rows.append(row)
        print(f"{name:45s} {ms * 1e3:9.1f} us  {rate / bw:5.2f} of copy; graph {row.get('graph_us')} us "
              f"{row.get('graph_frac_copy')} of copy", file=sys.stderr)
    res = {"bench": "quant", "shape": [args.rows, args.k], "dtype": "bf16", "copy_TBps": round(bw / 1e12, 3),
           **{f"{name}_config": quant_triton.CONFIG[name] for name in PAIR_ENTRIES + DEQUANT_ENTRIES},
           "machine": machine(), "results": rows}
    print(json.dumps(res))
    return res


def check_ops(only, names) -> None:
    """SystemExit naming each ``--ops`` substring that no op name in ``names`` contains (such a substring was
    dropped without a word: a typo timed nothing, or only the other ops, and exited 0)."""
    unmatched = [o for o in only if not any(o in name for name in names)]
    if unmatched:
        raise SystemExit(f"--ops {','.join(only)}: {unmatched} in no op name; the ops: {', '.join(names)}")


def _set_config(item: str) -> None:
    """``--set ENTRY.KEY=INT``: quant_triton.CONFIG[ENTRY][KEY] = INT (0 removes KEY)."""
    try:
        path, value = item.split("=")
        entry, key = path.split(".")
        v = int(value)
    except ValueError:
        raise SystemExit(f"--set takes ENTRY.KEY=INT, got {item!r}") from None
    if entry not in quant_triton.CONFIG:
        raise SystemExit(f"--set {item!r}: no CONFIG entry {entry!r}, expected one of {sorted(quant_triton.CONFIG)}")
    cfg = {k: x for k, x in quant_triton.CONFIG[entry].items() if k != key}
    quant_triton.CONFIG[entry] = {**cfg, key: v} if v else cfg


def sweep(rows: int, k: int, configs, ops_filter=()) -> dict:
    """Device time (CUDA graph; a checked op's host sync: median wall time) of every kernel op under each config
    of SWEEP, or of the ops whose names contain a string of ops_filter (a config that fails is reported and
    skipped)."""
    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    bw = copy_bandwidth(256 << 20)
    saved = (quant_triton.PAIR_KERNEL, {n: dict(c) for n, c in quant_triton.CONFIG.items()})
    best = {}
    t0 = time.perf_counter()
    try:
        for cfg in configs:
            if time.perf_counter() - t0 > SWEEP_BUDGET_S:
                print(json.dumps({"config": cfg, "skipped": "sweep time budget spent"}))
                continue
            quant_triton.PAIR_KERNEL = cfg["pair"]
            for name in PAIR_ENTRIES + DEQUANT_ENTRIES if cfg["pair"] else ("elem",):
                quant_triton.CONFIG[name] = {"tile": cfg["tile"], "num_warps": cfg["num_warps"]}
            try:
                ops = cases(x, rows, k)
            except Exception as e:  # a config the kernel cannot compile
                print(json.dumps({"config": cfg, "error": repr(e)[:200]}))
                continue
            check_ops(ops_filter, [name for name in ops if not name.startswith("reference")])  # (none timed here)
            for name, (fn, nbytes) in ops.items():
                if name.startswith("reference"):
                    continue
                if ops_filter and not any(f in name for f in ops_filter):
                    continue
                try:
                    ms = median_ms(fn, warmup=2, reps=7) if name.endswith("_checked") else graph_ms(fn)
                except Exception as e:
                    print(json.dumps({"op": name, "config": cfg, "error": repr(e)[:200]}))
                    continue
                frac = nbytes / (ms * 1e-3) / bw
                print(json.dumps({"op": name, "config": cfg, "time_us": round(ms * 1e3, 1),
                                  "frac_copy": round(frac, 3)}), flush=True)
                if name not in best or ms * 1e3 < best[name]["time_us"]:
                    best[name] = {"config": cfg, "time_us": round(ms * 1e3, 1), "frac_copy": round(frac, 3)}
    finally:
        quant_triton.PAIR_KERNEL, cfgs = saved
        quant_triton.CONFIG.update(cfgs)
    res = {"sweep": "quant", "shape": [rows, k], "copy_TBps": round(bw / 1e12, 3), "best": best,
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
