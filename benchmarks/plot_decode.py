"""Plot ``bench_decode.py`` JSON lines: decode tokens/s vs batch, one panel per context length, BF16 vs FP4.

Solid lines: GPU time of a step (the profiler's kernel time, ``--profile`` rows; else the CUDA-graph replay);
dashed: eager (host loop included).
Usage: python benchmarks/plot_decode.py RESULTS.jsonl OUT.png
"""

from __future__ import annotations

import json
import sys

COLORS = {"bf16": "tab:blue", "fp4f": "tab:red", "fp4": "tab:purple", "fp4u": "tab:orange"}


def load(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                rows.append(json.loads(line))
    return [r for r in rows if r.get("bench") == "decode" and "error" not in r]


def plot(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(lengths)), figsize=(4.5 * max(1, len(lengths)), 3.8), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for mode, color in COLORS.items():
            pts = sorted((r["batch"], r) for r in rows if r["context"] == length and r["mode"] == mode)
            if not pts:
                continue
            xs = [b for b, _ in pts]
            ax.plot(xs, [r["eager_tok_s"] for _, r in pts], "--o", color=color, alpha=0.6, label=f"{mode} eager")
            gpu = [(b, b * 1e3 / r["profile"]["step_ms"]) for b, r in pts if r.get("profile", {}).get("step_ms")]
            graph = [(b, r["graph_tok_s"]) for b, r in pts if "graph_tok_s" in r]
            if gpu:
                ax.plot(*zip(*gpu), "-s", color=color, label=f"{mode} GPU time")
            elif graph:
                ax.plot(*zip(*graph), "-s", color=color, label=f"{mode} CUDA graph")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_title(f"context {length // 1024}K" if length >= 1024 else f"context {length}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("hf rollout decode: BF16 vs FP4 (W4A16 Triton + FP4 KV)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: plot_decode.py RESULTS.jsonl OUT.png")
    rows = load(argv[0])
    if not rows:
        raise SystemExit(f"{argv[0]}: no decode rows to plot")
    plot(rows, argv[1])


if __name__ == "__main__":
    main()
