"""``benchmarks/_timing.interleaved_ms``'s round order (on the CPU: wall-clock times of stub steps)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_rounds_never_run_a_variant_twice_in_a_row_and_pair_neighbours_both_ways(bench_module, n):
    timing = bench_module("_timing")
    calls = []
    fns = {f"v{i}": (lambda i=i: calls.append(i)) for i in range(n)}
    warmup, reps = 2, 8
    times = timing.interleaved_ms(fns, "cpu", warmup, reps)
    assert all(len(t) == reps for t in times.values())
    timed = calls[warmup * n:]
    assert len(timed) == reps * n and all(sorted(timed[r * n:(r + 1) * n]) == list(range(n)) for r in range(reps))
    # a step right after itself runs warm: no variant may get that in some rounds and another never
    repeats = [(a, i) for i, (a, b) in enumerate(zip(calls, calls[1:])) if a == b]
    assert repeats == []
    # ... and a variant after its neighbour in the given order also runs before it (siblings of one model)
    follows = set(zip(timed, timed[1:]))
    assert all((i + 1, i) in follows and (i, i + 1) in follows for i in range(n - 1))
