"""Per-rank result files of the multi-process benchmarks: each rank writes rank{r}.json (rows, fails) or
error{r}.txt (its traceback); the parent gathers them and prints one JSON line per row plus a summary."""

from __future__ import annotations

import json
import os

from megatron_trace.testing.megatron_cpu import record_errors  # noqa: F401  (re-exported for the benchmarks)


def write_result(tmp: str, rank: int, rows: list[dict], fails: list[str]) -> None:
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as fh:
        json.dump({"rows": rows, "fails": fails}, fh)


def gather(tmp: str, world: int, codes) -> tuple[list[dict], list[str]]:
    """All ranks' rows and fails; a missing result or a traceback becomes a fail naming the exit codes."""
    def read(name):
        path = os.path.join(tmp, name)
        return open(path).read() if os.path.exists(path) else None

    errors = [e for e in (read(f"error{r}.txt") for r in range(world)) if e]
    results = [json.loads(t) for t in (read(f"rank{r}.json") for r in range(world)) if t]
    rows = [row for res in results for row in res["rows"]]
    fails = [f for res in results for f in res["fails"]]
    if errors or len(results) != world:
        fails.append(f"worker failed (exit codes {codes}): {errors[-1][-3000:] if errors else ''}")
    return rows, fails


def emit(rows: list[dict], out: str | None) -> None:
    text = "\n".join(json.dumps(row) for row in rows)
    print(text, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(text + "\n")
