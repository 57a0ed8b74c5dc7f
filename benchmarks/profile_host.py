"""Where a prefill-heavy ``HFRolloutBackend.generate`` spends its host time: cProfile of one generate per mode.

At batch 8 with 2048-token prompts the FP4 generate's wall time (175-205 ms on the H200) is about twice its GPU
kernel time (81 ms; BENCHMARKS.md, session 30), so the host decides it. Per mode one JSON line: the generate's wall
time (median of ``--reps`` unprofiled runs after a warm-up), the profiled one's, and the ``--top`` functions by own
time, by cumulative time and by calls (file:line(function), calls, seconds). A CUDA sync shows as the time of the
call that waits (``synchronize``, ``item``, ``tolist``, ``cpu``). cProfile's own cost per Python call inflates code
that makes many small calls: ``rollout.base.check_prompts`` (33K ``isinstance`` calls) showed 7 ms here, 0.74 ms
unprofiled (CPU, 8 x 2048 ids). Usage (H200, carry .whl):
    python3 benchmarks/profile_host.py [--modes bf16,fp4] [--batch 8] [--prompt 2048] [--tokens 1] [--top 25]
"""

from __future__ import annotations

import json
import pstats
import statistics

from bench_decode import backends_of, generate_parser, generate_walls, profiled_generate, random_prompts

from megatron_trace.rollout import SamplingParams


def _rows(stats: pstats.Stats, key: str, top: int) -> list:
    """[[file:line(function), calls, own s, cumulative s]] of the ``top`` entries by ``key`` (tottime, cumtime,
    ncalls)."""
    col = {"tottime": 2, "cumtime": 3, "ncalls": 1}[key]
    rows = [[f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}({fn[2]})", st[1], round(st[2], 4), round(st[3], 4)]
            for fn, st in stats.stats.items()]
    return sorted(rows, key=lambda r: -r[col])[:top]


def run(be, mode: str, batch: int, prompt: int, tokens: int, reps: int, top: int) -> dict:
    prompts = random_prompts(be, batch, prompt)
    sp = SamplingParams(max_new_tokens=tokens, seed=0, stop_token_ids=())
    walls = generate_walls(be, prompts, sp, reps)
    profiled, stats = profiled_generate(be, prompts, sp)
    return {"bench": "generate_host", "mode": mode, "batch": batch, "prompt": prompt, "new_tokens": tokens,
            "wall_ms": round(statistics.median(walls) * 1e3, 1), "walls_ms": [round(w * 1e3, 1) for w in walls],
            "profiled_ms": round(profiled * 1e3, 1), "calls": stats.total_calls,
            "by_own_time": _rows(stats, "tottime", top), "by_cumulative": _rows(stats, "cumtime", top),
            "by_calls": _rows(stats, "ncalls", top)}


def main(argv=None) -> None:
    p = generate_parser(__doc__, batch=8, prompt=2048, tokens=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    backends = backends_of(a)
    for m in modes:
        print(json.dumps(run(backends[m], m, a.batch, a.prompt, a.tokens, a.reps, a.top)), flush=True)


if __name__ == "__main__":
    main()
