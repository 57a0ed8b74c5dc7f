"""Plot, table and planner projections from ``benchmarks/ep_scaling.py`` JSON lines (issue 10).

    python3 benchmarks/plot_ep_scaling.py ep.jsonl --png ep_scaling.png --md ep_scaling.md [--json proj.json]

PNG (matplotlib, Agg): step time, tokens/s and TRACE overhead vs EP, one line per (mode, experts, variant).
Markdown: the measured points (with the planner's bytes for each point's own config and the sync time the raw send
bandwidth predicts for its payload), then ``guidance.planner.rank_projection`` for Qwen3-235B-A22B and DeepSeek-V3
(``tests/data`` configs) at production batch sizes, with the sync time at the measured bandwidths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {  # name -> HF config (public values, see tests/data/README.md)
    "Qwen3-235B-A22B": os.path.join(ROOT, "tests", "data", "qwen3_235b_a22b_config.json"),
    "DeepSeek-V3": os.path.join(ROOT, "tests", "data", "deepseek_v3_config.json"),
}
STEP = dict(trajectories=4096, prompt_len=1024, response_len=8192)  # the planner CLI's default RL step
DP_RANKS = (8, 32, 128)  # trainer data-parallel ranks receiving a shard each
LINK_GBPS = 50.0  # 400 Gbit/s NIC, for reference next to the measured bandwidths


def load(path: str) -> list[dict]:
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip().startswith("{")]
    return [r for r in rows if r.get("bench") == "ep_scaling" and not r.get("summary") and "ep" in r]


def series(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(mode, experts) -> rows sorted by EP (the last row wins for a repeated EP)."""
    out: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        out[(r["mode"], r["shape"]["experts"])][r["ep"]] = r
    order = {"weak": 0, "strong": 1}
    return {k: [v[e] for e in sorted(v)] for k, v in sorted(out.items(), key=lambda kv: (order.get(kv[0][0], 2),
                                                                                         kv[0]))}


def plot(rows: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    all_eps = sorted({r["ep"] for r in rows})
    markers = dict(zip(sorted({r["shape"]["experts"] for r in rows}), "osD^v"))
    for (mode, experts), pts in series(rows).items():
        eps = [p["ep"] for p in pts]
        kw = dict(linestyle="-" if mode == "weak" else "--", marker=markers[experts])
        for var, color in (("fp4_qat", "C0"), ("trace", "C1")):
            label = f"{var} {mode} E={experts}"
            axes[0].plot(eps, [p[f"{var}_step_ms"] for p in pts], color=color, label=label, **kw)
            axes[1].plot(eps, [p[f"{var}_tokens_per_s"] for p in pts], color=color, label=label, **kw)
        axes[2].plot(eps, [100 * p["trace_overhead"] for p in pts], color="C1", label=f"{mode} E={experts}", **kw)
    titles = ("step time (ms)", "tokens / s (all ranks)", "TRACE overhead vs FP4 QAT (%)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_eps, [str(e) for e in all_eps])
        ax.set_xlabel("EP (= GPUs)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_caption(rows), fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _caption(rows: list[dict]) -> str:
    if not rows:
        return "no points"
    s, r = rows[0]["shape"], rows[0]
    weak = sorted({x["batch_per_rank"] for x in rows if x["mode"] == "weak"})
    strong = sorted({x["batch_per_rank"] * x["ep"] for x in rows if x["mode"] == "strong"})
    return (f"{r['device']}: {s['layers']} layers, hidden {s['hidden']}, top-{s['topk']}, expert ffn {s['moe_ffn']}, "
            f"seq {s['seq']}; weak: {weak} seq/rank, strong: {strong} seq in all")


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def points_table(rows: list[dict]) -> str:
    head = ("EP", "mode", "experts", "seq/rank", "FP4 QAT ms", "TRACE ms", "overhead", "TRACE tok/s",
            "guidance MiB/rank", "sync payload MiB/rank", "cache host MiB/rank", "bytes == planner", "sync s",
            "sync GB/s", "raw GB/s", "payload / raw GB/s (s)", "assemble ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (_, _), pts in series(rows).items():
        for p in pts:
            pred = None if not p.get("raw_send_GBps") else p["planner"]["sync_payload"] / (p["raw_send_GBps"] * 1e9)
            lines.append("| " + " | ".join([
                str(p["ep"]), p["mode"], str(p["shape"]["experts"]), str(p["batch_per_rank"]),
                f"{p['fp4_qat_step_ms']:.1f}", f"{p['trace_step_ms']:.1f}", f"{100 * p['trace_overhead']:+.1f}%",
                f"{p['trace_tokens_per_s']:,.0f}", _mib(p["guidance_bytes_per_rank"]),
                _mib(p.get("sync_payload_bytes_per_rank") or p["planner"]["sync_payload"]),
                _mib(p["cache_host_bytes_per_rank"]), "yes" if p["bytes_match_planner"] else "**NO**",
                _f(p.get("sync_s"), ".4f"), _f(p.get("sync_GBps"), ".2f"), _f(p.get("raw_send_GBps"), ".2f"),
                _f(pred, ".4f"), f"{p['assemble_ms']:.1f}"]) + " |")
    return "\n".join(lines)


def measured_bandwidths(rows: list[dict]) -> dict[str, float]:
    """GB/s of the transfer with the most bytes: the guidance sync (CRC-verified) and the raw send."""
    synced = [r for r in rows if r.get("sync_GBps")]
    if not synced:
        return {}
    best = max(synced, key=lambda r: r["sync_payload_bytes_per_rank"])
    return {"guidance sync (measured)": best["sync_GBps"], "raw send (measured)": best["raw_send_GBps"]}


def projections(rows: list[dict], models: dict[str, str] = MODELS, dp_ranks=DP_RANKS, step=STEP) -> list[dict]:
    """``rank_projection`` of each model at the benchmark's TRACE config (compact, deepest half, all four sites,
    routing replay), for each trainer DP size; sync seconds at the measured bandwidths and a 400 Gbit/s link."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.guidance.model_dims import ModelDims
    from megatron_trace.guidance.planner import RLSettings, rank_projection

    cfg = TraceConfig(guided_layers="fraction", guided_fraction=0.5, cache_mode="compact", routing_replay=True)
    bw = {**measured_bandwidths(rows), "400 Gbit/s link": LINK_GBPS}
    rl = RLSettings(**step)
    out = []
    for name, path in models.items():
        dims = ModelDims.from_hf_config(path)
        for n in dp_ranks:
            out.append({"model": name, **step, **rank_projection(dims, cfg, rl, dp_ranks=n, bandwidths_gbytes=bw)})
    return out


def projection_table(proj: list[dict]) -> str:
    if not proj:
        return ""
    bws = list(proj[0]["sync_seconds"])
    head = ("model", "DP ranks", "tokens/rank", "guidance GiB/rank", "routing GiB/rank", "cache host GiB/rank",
            "sync payload GiB/rank", *[f"sync s @ {b}" for b in bws])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in proj:
        gib = [p[k] / 2**30 for k in ("guidance_bytes_per_rank", "routing_bytes_per_rank",
                                      "cache_host_bytes_per_rank", "sync_payload_bytes_per_rank")]
        lines.append("| " + " | ".join([p["model"], str(p["dp_ranks"]), f"{p['tokens_per_rank']:,}",
                                        *[f"{g:,.1f}" for g in gib],
                                        *[f"{p['sync_seconds'][b]:,.1f}" for b in bws]]) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict], proj: list[dict]) -> str:
    st = STEP
    return "\n".join([
        f"### EP scaling: measured points ({_caption(rows)})", "", points_table(rows), "",
        "bytes == planner: guidance, cache host, routing and sync payload bytes per rank equal "
        "`guidance.planner.shard_bytes` for the point's own config. `payload / raw GB/s`: the sync time the raw "
        "send bandwidth predicts for the planner's payload.", "",
        f"### Planner projection per trainer rank: {st['trajectories']} trajectories x ({st['prompt_len']} + "
        f"{st['response_len']}) tokens per step, compact, deepest half, all four sites, routing replay", "",
        projection_table(proj), ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jsonl")
    p.add_argument("--png", default="ep_scaling.png")
    p.add_argument("--md", default=None, help="write the markdown tables here (else print them)")
    p.add_argument("--json", default=None, help="write the projections as JSON here")
    a = p.parse_args(argv)
    rows = load(a.jsonl)
    if not rows:
        print(f"error: no ep_scaling points in {a.jsonl}", file=sys.stderr)
        return 2
    bad = [k for r in rows for k in ("fp4_qat_step_ms", "trace_step_ms") if not math.isfinite(r[k])]
    if bad:
        print(f"warning: non-finite times in {bad}", file=sys.stderr)
    try:
        plot(rows, a.png)
    except ImportError as e:  # e.g. a GPU image without matplotlib: tables still written, plot later
        print(f"warning: no plot ({e}); run this script where matplotlib is installed", file=sys.stderr)
    proj = projections(rows)
    text = markdown(rows, proj)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(text)
    else:
        print(text)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(proj, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
