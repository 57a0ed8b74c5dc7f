"""A few readable lines from ``bench_qat_step.py``'s JSON: step times, the same-run ratios and, with ``--gaps``,
each variant's idle time and the host ops before its largest gaps (what the device session scripts print).

    python3 benchmarks/step_summary.py RESULT.json [--top 6]
"""

from __future__ import annotations

import argparse
import json

IDLE_KEYS = ("span_ms", "busy_ms", "idle_ms", "gaps_over_min_ms", "host_late_ms")


def summary(result: dict, top: int = 6) -> list[str]:
    """The lines: step ms per variant, the round ratios, then per variant its idle figures and ``top`` items."""
    lines = [json.dumps(result["step_ms"]), json.dumps(result.get("round_ratio_median", {}))]
    for name, g in (result.get("gaps") or {}).items():
        lines.append(f"== {name} " + json.dumps({k: g[k] for k in IDLE_KEYS if k in g}))
        lines += [f"    {row}" for row in g.get("by_launching_op", [])[:top]]
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a bench_qat_step.py JSON file")
    p.add_argument("--top", type=int, default=6, help="host ops listed per variant (with --gaps results)")
    a = p.parse_args(argv)
    with open(a.result) as fh:
        print("\n".join(summary(json.load(fh), a.top)))


if __name__ == "__main__":
    main()
