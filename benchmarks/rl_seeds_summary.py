"""Summarise a multi-seed run of the five arms (``benchmarks/gpu_rl_seeds.sh``): table, JSON, plots.

    python benchmarks/rl_seeds_summary.py DIR [--out OUTDIR]

DIR holds ``metrics_s<seed>_<arm>.jsonl`` (one arm of one seed each). Prints one JSON line per arm (means and
standard deviations over the seeds), writes ``summary.md`` (a markdown table plus the per-seed mismatch
ordering) and ``reward_seeds.png`` / ``mismatch_seeds.png`` to OUTDIR (default: DIR).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ARMS = ("bf16", "fp4_naive", "fp4_qat", "trace", "trace_full")
MISMATCH = ("mismatch/logprob_abs_diff", "mismatch/kl_k3")


def load(d: Path) -> dict[str, dict[int, list[dict]]]:
    """arm -> seed -> rows in step order."""
    out: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for p in sorted(d.glob("metrics_s*_*.jsonl")):
        m = re.fullmatch(r"metrics_s(\d+)_(\w+)\.jsonl", p.name)
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        if m and rows:
            out[m.group(2)][int(m.group(1))] = sorted(rows, key=lambda r: r["step"])
    return dict(out)


def _vals(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), int | float)]


def per_seed(rows: list[dict]) -> dict[str, float | None]:
    """One seed of one arm: the numbers of the summary table."""
    def mean(key, last=None):
        v = _vals(rows, key)
        v = v[-last:] if last else v
        return sum(v) / len(v) if v else None

    def median(key):
        v = _vals(rows, key)
        return statistics.median(v) if v else None

    first5 = _vals(rows, "reward")[:5]  # (the first 5 rewards: a row without one counted 0, no reward at all 0 +- 0)
    return {
        "steps": float(len(rows)), "reward_first5": sum(first5) / len(first5) if first5 else None,
        "reward_last5": mean("reward", 5),
        "accuracy_start": mean("eval/accuracy_start"), "accuracy_end": mean("eval/accuracy"),
        "logprob_abs_diff": mean(MISMATCH[0]), "kl_k3": mean(MISMATCH[1]),
        "fc1_code_mismatch": mean("quant/expert_fc1_in/code_mismatch_rate"),
        "guided_code_mismatch": mean("quant/guided/code_mismatch_rate"),
        "bytes_per_token": mean("cache/bytes_per_token"),
        "step_s_median": median("time/step_s"), "train_s_median": median("time/train_s"),
        "guidance_s_median": median("time/guidance_s"),
    }


def aggregate(data: dict[str, dict[int, list[dict]]]) -> dict[str, dict]:
    out = {}
    for arm in [a for a in ARMS if a in data] + sorted(set(data) - set(ARMS)):
        seeds = {s: per_seed(rows) for s, rows in sorted(data[arm].items())}
        agg = {"arm": arm, "seeds": sorted(seeds)}
        for k in next(iter(seeds.values())):
            v = [x[k] for x in seeds.values() if x[k] is not None]
            agg[k] = statistics.fmean(v) if v else None
            agg[k + "_std"] = statistics.stdev(v) if len(v) > 1 else None
        agg["per_seed"] = seeds
        out[arm] = agg
    return out


def _fmt(v, std=None) -> str:
    if v is None:
        return "-"
    s = f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return s if std is None else s + f" ± {std:.2g}"


def table(agg: dict[str, dict]) -> str:
    cols = [("steps", "steps"), ("reward_first5", "reward first 5"), ("reward_last5", "reward last 5"),
            ("accuracy_start", "greedy acc. start"), ("accuracy_end", "greedy acc. end"),
            ("logprob_abs_diff", "logprob_abs_diff"), ("kl_k3", "kl_k3"), ("fc1_code_mismatch", "FC1 code mismatch"),
            ("guided_code_mismatch", "code mismatch at guided sites"), ("bytes_per_token", "guidance bytes/token"),
            ("step_s_median", "step s (median)"), ("train_s_median", "train s (median)")]
    lines = ["| arm | seeds | " + " | ".join(c for _, c in cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for a in agg.values():
        cells = [_fmt(a[k], a.get(k + "_std") if k != "steps" else None) for k, _ in cols]
        lines.append(f"| {a['arm']} | {len(a['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ordering(agg: dict[str, dict]) -> list[str]:
    """Per seed and metric: the arms sorted by mismatch, and trace's ratio to the bf16 floor."""
    out = []
    seeds = sorted({s for a in agg.values() for s in a["per_seed"]})
    for s in seeds:
        for key in ("logprob_abs_diff", "kl_k3"):
            vals = {a: agg[a]["per_seed"][s][key] for a in agg if s in agg[a]["per_seed"]}
            vals = {a: v for a, v in vals.items() if v is not None}
            order = " < ".join(f"{a} ({v:.3g})" for a, v in sorted(vals.items(), key=lambda kv: kv[1]))
            ratio = (f"; trace / bf16 = {vals['trace'] / vals['bf16']:.2f}x"
                     if "trace" in vals and vals.get("bf16") else "")
            out.append(f"- seed {s}, {key}: {order}{ratio}")
    return out


def plot(data: dict[str, dict[int, list[dict]]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, keys, log in (("reward_seeds.png", ("reward",), False), ("mismatch_seeds.png", MISMATCH, True)):
        fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
        for ax, key in zip(axes[0], keys):
            for arm in [a for a in ARMS if a in data]:
                by_step = defaultdict(list)
                for rows in data[arm].values():
                    for r in rows:
                        if isinstance(r.get(key), int | float):
                            by_step[r["step"]].append(r[key])
                x = sorted(by_step)
                ax.plot(x, [statistics.fmean(by_step[i]) for i in x], label=f"{arm} (n={len(data[arm])})")
                ax.fill_between(x, [min(by_step[i]) for i in x], [max(by_step[i]) for i in x], alpha=0.15)
            ax.set(xlabel="RL step", ylabel=key, title=f"{key}: mean (band: min-max) over seeds",
                   yscale="log" if log else "linear")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    data = load(a.dir)
    if not data:
        print(f"no metrics_s<seed>_<arm>.jsonl in {a.dir}", file=sys.stderr)
        return 1
    out = a.out or a.dir
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(data)
    for row in agg.values():
        print(json.dumps({k: v for k, v in row.items() if k != "per_seed"}))
    md = table(agg) + "\n\nMismatch ordering per seed (mean over the steps):\n\n" + "\n".join(ordering(agg)) + "\n"
    (out / "summary.md").write_text(md)
    plot(data, out)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
