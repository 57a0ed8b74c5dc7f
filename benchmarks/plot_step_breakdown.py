"""Stacked bars of where a decode step's GPU time goes, from ``bench_decode.py --profile`` rows.

One bar per (file, mode, batch, context): the profiler's kernel time of a step split into the expert GEMM, the
attention kernels, transformers' dense GEMMs, the activation quantize and everything else (small kernels; what the
listed ``top_kernels`` leave out is counted there too). Usage:
    python benchmarks/plot_step_breakdown.py OUT.png LABEL=RESULTS.jsonl [LABEL=RESULTS.jsonl ...]
"""

from __future__ import annotations

import argparse
import json

PARTS = (  # (label, kernel-name fragments), first match wins
    ("expert GEMM", ("fp4_gemm_kernel", "cutlass", "prepare_grouped_gemm")),
    ("attention", ("fp4kv_decode_attn", "sdpa", "flash", "combine_kernel", "lean_reduction")),
    ("dense GEMMs", ("nvjet", "gemm")),
    ("activation quantize", ("pair_kernel",)),
)
OTHER = "small kernels"
COLORS = {"expert GEMM": "tab:red", "attention": "tab:blue", "dense GEMMs": "tab:gray",
          "activation quantize": "tab:orange", OTHER: "tab:olive"}


def split(row: dict) -> dict[str, float]:
    """ms per part of one profiled decode row."""
    prof = row["profile"]
    parts = dict.fromkeys([p for p, _ in PARTS] + [OTHER], 0.0)
    for name, ms in prof["top_kernels"]:
        label = next((p for p, keys in PARTS if any(k in name for k in keys)), OTHER)
        parts[label] += ms
    parts[OTHER] += max(prof["step_ms"] - sum(parts.values()), 0.0)
    return parts


def bars(specs: list[str]) -> list[tuple[tuple, str, dict[str, float], int | None]]:
    """(sort key, bar label, ms per part, kernels per step) per profiled row of the ``LABEL=PATH`` specs. A spec
    without ``=`` or whose file holds no profiled decode row (``bench_decode.py --profile``) is refused by name."""
    out, empty = [], []
    for spec in specs:
        if "=" not in spec:
            raise ValueError(f"{spec!r}: a spec is LABEL=RESULTS.jsonl (e.g. 30B-A3B=results/s13/decode.jsonl)")
        label, path = spec.split("=", 1)
        before = len(out)
        for line in open(path):
            row = json.loads(line)
            if row.get("bench") == "decode" and "profile" in row and "top_kernels" in row["profile"]:
                name = f"{label}\n{row['mode']} b{row['batch']} {row['context'] // 1024}K"
                key = (row["batch"], row["context"], row["mode"], specs.index(spec))
                out.append((key, name, split(row), row["profile"].get("kernels_per_step")))
        if len(out) == before:
            empty.append(spec)
    if empty:
        raise ValueError(f"no profiled decode rows (bench 'decode' with profile.top_kernels: bench_decode.py "
                         f"--profile) in {', '.join(empty)}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_png", metavar="OUT.png")
    p.add_argument("specs", nargs="+", metavar="LABEL=RESULTS.jsonl")
    a = p.parse_args(argv)
    try:
        found = bars(a.specs)
    except ValueError as e:
        p.error(str(e))
    out_png = a.out_png
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [b[1:] for b in sorted(found, key=lambda b: b[0])]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(data)), 4.5))
    xs = range(len(data))
    bottom = [0.0] * len(data)
    for part in [p for p, _ in PARTS] + [OTHER]:
        vals = [d[1][part] for d in data]
        ax.bar(xs, vals, bottom=bottom, color=COLORS[part], label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, (_, _, n), top in zip(xs, data, bottom):
        if n:
            ax.text(x, top, f"{n:.0f} kernels", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [d[0] for d in data], fontsize=7)
    ax.set_ylabel("GPU ms per decode step (profiler)")
    ax.set_title("Decode step GPU time by kernel kind")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=130)
    print(json.dumps({"plot": out_png, "bars": [[d[0].replace("\n", " "), round(sum(d[1].values()), 3)]
                                                 for d in data]}))


if __name__ == "__main__":
    main()
