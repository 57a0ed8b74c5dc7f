"""Plot ``bench_static_decode.py`` JSON lines: graph-replayed decode tokens/s vs batch, one panel per context, BF16
vs FP4, with the FP4 / BF16 ratio at each point; ``--extra FILE``: points of a later run drawn as hollow markers.
Usage: python benchmarks/plot_static_decode.py RESULTS.jsonl OUT.png [--extra LATER.jsonl] [--extra-label TEXT]
    [--title TEXT]
"""

from __future__ import annotations

import argparse
import json

COLORS = {"bf16": "tab:blue", "fp4": "tab:red"}


def load(path: str) -> dict[tuple, float]:
    """(mode, context, batch) -> graph tokens/s."""
    out = {}
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                r = json.loads(line)
                if r.get("bench") == "static_decode" and "graph_tok_s" in r:
                    out[(r["mode"], r["prompt"], r["batch"])] = r["graph_tok_s"]
    return out


def plot(points: dict, extra: dict, out: str, title: str, extra_label: str = "later run") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({c for _, c, _ in points})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for mode, color in COLORS.items():
            pts = sorted((b, v) for (m, c, b), v in points.items() if m == mode and c == ctx)
            if pts:
                ax.plot(*zip(*pts), "o-", color=color, label=mode)
            later = sorted((b, v) for (m, c, b), v in extra.items() if m == mode and c == ctx)
            if later:
                ax.plot(*zip(*later), "o", mfc="none", color=color, ms=10, label=f"{mode} ({extra_label})")
        for (m, c, b), v in points.items():
            bf = points.get(("bf16", c, b))
            if m == "fp4" and c == ctx and bf:
                ax.annotate(f"{v / bf:.2f}x", (b, v), textcoords="offset points", xytext=(4, 6), fontsize=8)
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s (graph replay)", title=f"context {ctx}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("out")
    p.add_argument("--extra", default=None)
    p.add_argument("--extra-label", default="later run")
    p.add_argument("--title", default="decode with CUDA graphs, H200")
    a = p.parse_args(argv)
    points, extra = load(a.results), load(a.extra) if a.extra else {}
    for path, got in ((a.results, points), (a.extra, extra)):
        if path and not got:  # (before: a matplotlib error of 0 columns, or an --extra file drawn as nothing)
            p.error(f"{path}: no static_decode row with graph_tok_s (bench_static_decode.py output)")
    plot(points, extra, a.out, a.title, a.extra_label)


if __name__ == "__main__":
    main()
