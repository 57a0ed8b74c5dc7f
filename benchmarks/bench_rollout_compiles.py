"""Triton compiles inside rollouts (``HFRolloutBackend.generate``), and what they cost.

A decode step attends T rows. In the eager loop (``--static-decode off``) T grows by one per step; with static
decode (the default on CUDA) T is the generate's buffer, the longest prompt plus the new tokens rounded up to 16,
so it changes with each batch's longest prompt. A kernel whose constexprs follow T (before session 49: the decode
attention's split count) compiles a new variant whenever they change, inside the rollout. Per mode: ``--rounds``
generates of ``--batch`` random prompts with ``--tokens`` new tokens each (no stop tokens), round i's prompts of
the i-th length of ``--widths`` (cycled; default ``--prompt``), in a fresh Triton cache directory (every variant a
real compile; a TRITON_CACHE_DIR set by the caller is not used). The modes run one after the other in one process,
so a later mode does not count the variants an earlier one compiled: for each mode's own count, one mode per run
(``fp4`` here is the backend's default, the fast FP4-KV attention). Prints one JSON line per generate: its wall
seconds and the Triton compiles it ran (each kernel's count, and the seconds from Triton's pre-compile hook to its
post-compile hook summed), then a summary line.
Usage (H100/H200, carry .whl):
    python3 benchmarks/bench_rollout_compiles.py [--modes bf16,fp4] [--batch 8] [--prompt 128] [--tokens 1024]
        [--rounds 2] [--static-decode off|auto] [--widths 96,160,224]
``--smoke``: the tiny model on the CPU (no Triton: zero compiles), a few seconds.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time

import torch
from bench_decode import _sync, backends_of, generate_parser, random_prompts

from megatron_trace.rollout import SamplingParams


class CompileLog:
    """Triton's JIT hooks: compiles per kernel name and the seconds between each one's pre- and post-compile hook
    (a kernel loaded from Triton's cache directory counts too, but the benchmark starts with an empty one)."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.seconds = 0.0
        self._started: dict = {}

    def __enter__(self):
        from triton import knobs

        self._knobs = knobs.runtime
        self._saved = (self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook)
        self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc):
        self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._saved

    def _before(self, *, key, fn, **_):
        self._started[str(key)] = time.perf_counter()
        return False  # compile as usual

    def _after(self, *, key, fn, **_):
        self.counts[fn.name] += 1
        self.seconds += time.perf_counter() - self._started.pop(str(key), time.perf_counter())

    def take(self) -> dict:
        row = {"compiles": sum(self.counts.values()), "compile_s": round(self.seconds, 3),
               "by_kernel": dict(self.counts.most_common())}
        self.counts.clear()
        self.seconds = 0.0
        return row


class _NoTriton:
    """``CompileLog``'s stand-in where no Triton kernel runs (the CPU): zero compiles."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def take(self) -> dict:
        return {"compiles": 0, "compile_s": 0.0, "by_kernel": {}}


def main(argv=None) -> list[dict]:
    p = generate_parser(__doc__, batch=8, prompt=128, tokens=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--static-decode", choices=("off", "auto"), default="off")
    p.add_argument("--widths", default=None, help="prompt lengths of rounds 0, 1, ... (cycled); default: --prompt")
    a = p.parse_args(argv)
    widths = [int(w) for w in a.widths.split(",")] if a.widths else [a.prompt]
    a.prompt = max(widths)  # (the model's positions)
    triton_used = torch.cuda.is_available() and not a.smoke
    caller_cache = os.environ.get("TRITON_CACHE_DIR")
    if triton_used:  # (before the first compile: Triton reads it then; always a fresh one, or cache loads count)
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")
    backends = backends_of(a, static_decode=a.static_decode)
    sp = SamplingParams(max_new_tokens=a.tokens, seed=0, stop_token_ids=())
    rows = []
    with (CompileLog() if triton_used else _NoTriton()) as log:
        for mode, be in backends.items():
            for rnd in range(a.rounds):
                width = widths[rnd % len(widths)]
                prompts = random_prompts(be, a.batch, width)
                _sync(be.device)
                t0 = time.perf_counter()
                out = be.generate(prompts, sp)
                _sync(be.device)
                sec = time.perf_counter() - t0
                row = {"bench": "rollout_compiles", "mode": mode, "static_decode": a.static_decode, "round": rnd,
                       "batch": a.batch, "prompt": width, "new_tokens": int(out.response_lens.max()),
                       "sec": round(sec, 3), "tok_s": round(int(out.response_lens.sum()) / sec, 1), **log.take()}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {"bench": "rollout_compiles_summary",
               "device": torch.cuda.get_device_name() if triton_used else "cpu",
               "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR") if triton_used else None,
               "caller_triton_cache_dir_not_used": caller_cache if triton_used else None,
               "compiles": {m: [r["compiles"] for r in rows if r["mode"] == m] for m in backends},
               "first_over_last": {m: round(r[0]["sec"] / r[-1]["sec"], 3) for m in backends
                                   for r in [[x for x in rows if x["mode"] == m]]}}
    print(json.dumps(summary), flush=True)
    return rows + [summary]


if __name__ == "__main__":
    main()
