"""Timing helpers for the GPU benchmarks: CUDA-event medians after warm-up, and the copy ceiling."""

from __future__ import annotations

import cProfile
import gc
import os
import platform
import pstats
import time

import torch


def median_ms(fn, *, warmup: int = 5, reps: int = 30) -> float:
    """Median over ``reps`` CUDA-event timings of ``fn()`` after ``warmup`` calls (L2 flushed between)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        times.append(_event_ms(fn))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn, *, calls: int = 10, reps: int = 5, flush_by: str = "write") -> float:
    """Device milliseconds per ``fn()`` without the host: ``calls`` calls, each after an L2 flush, captured in
    one CUDA graph and replayed ``reps`` times (median), minus the same graph of flushes alone. For ops whose
    launch overhead exceeds their kernel time, where ``median_ms`` times the host. ``flush_by``: "write" zeroes
    256 MB (L2 left holding dirty lines, which ``fn`` writes back as it evicts them), "read" reads it (L2 left
    clean)."""
    if flush_by not in ("write", "read"):
        raise ValueError(f"flush_by={flush_by!r} must be 'write' or 'read'")
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    sink = torch.empty(1, dtype=torch.int64, device="cuda")

    def flush_once():
        if flush_by == "write":
            flush.zero_()
        else:
            torch.sum(flush.view(torch.int64), dim=0, keepdim=True, out=sink)
    fn()
    torch.cuda.synchronize()

    def timed(body) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm the allocator for the captured calls
            body()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        g.replay()
        times = sorted(_event_ms(g.replay) for _ in range(reps))
        return times[len(times) // 2]

    def both():
        for _ in range(calls):
            flush_once()
            fn()

    def flushes():
        for _ in range(calls):
            flush_once()

    return max(timed(both) - timed(flushes), 0.0) / calls


def _event_ms(fn) -> float:
    """Milliseconds of ``fn()`` between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def step_median_ms(fn, device, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn()`` (a whole training step) after ``warmup`` calls: CUDA events on a CUDA
    ``device``, the wall clock elsewhere; no L2 flush."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            times.append(_event_ms(fn))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def interleaved_ms(fns: dict, device, warmup: int, reps: int, manual_gc: bool = False) -> dict[str, list[float]]:
    """Times of each ``fns[name]()`` (a whole training step) over ``reps`` rounds that run every function once
    in turn, after ``warmup`` rounds: drift of the machine (clocks, other tenants) hits every variant alike. Odd
    rounds run the functions in reverse order, so that no variant always follows the same one (a step right after
    another step of the same model runs with that model's data still warm: session 21 measured 2-3%), all but the
    last: ``[n-2, ..., 0, n-1]``, so that no variant runs twice in a row at a round's boundary (a plain reversal ran
    the last variant twice in a row in every odd round and the first in every later even one, and a variant right
    after itself came out faster in session 34's rounds).
    ``manual_gc``: Python's cyclic GC is frozen after warm-up and run between rounds, outside the timed
    calls (what Megatron-LM's ``--manual-gc`` does); otherwise a collection lands in whichever step
    allocates when it is due."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if manual_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    times: dict[str, list[float]] = {name: [] for name in fns}
    forward = list(fns.items())
    backward = forward[-2::-1] + forward[-1:]
    try:
        for r in range(reps):
            for name, fn in (backward if r % 2 else forward):
                if cuda:
                    times[name].append(_event_ms(fn))
                else:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
            if manual_gc:
                gc.collect()
    finally:
        if manual_gc:
            gc.enable()
            gc.unfreeze()
    return times


def median(values) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / (ms * 1e-3)


def machine() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
    }


def host_us(fn, calls: int, device: str, warmup: int = 20) -> float:
    """Wall microseconds per call over ``calls`` calls after ``warmup`` calls, no sync between calls."""
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    sync()
    return t / calls * 1e6


def profile_op(fn, calls: int, top: int = 25) -> list:
    """[function, calls, own us per op call] of the ``top`` functions by own time over ``calls`` calls."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    st = pstats.Stats(prof).stats
    rows = sorted(((f"{os.path.basename(k[0])}:{k[1]} {k[2]}", v[1], v[2]) for k, v in st.items()), key=lambda r: -r[2])
    return [[name, n, round(t / calls * 1e6, 2)] for name, n, t in rows[:top]]
