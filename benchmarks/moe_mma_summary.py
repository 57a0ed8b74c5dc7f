"""One line per point of ``bench_moe_mma.py``'s JSON or ``bench_moe_mma_routing.py``'s JSON lines (the device scripts'
summaries). Usage: ``python3 benchmarks/moe_mma_summary.py RESULT.json|RESULT.jsonl``."""

from __future__ import annotations

import json
import sys


def lines(path: str) -> list[str]:
    text = open(path).read()
    if path.endswith(".jsonl"):  # bench_moe_mma_routing
        out = []
        for r in map(json.loads, filter(None, text.splitlines())):
            out.append(" ".join(str(v) for v in (
                r["shape"], r["fmt"], "b", r["batch"], "act", r["active_experts"], "max", r["max_tokens"], "bf16",
                r["bf16_us"], "triton", r["triton_us"], "mma", r["mma_us"], "packed", r["mma_packed_us"], "grid",
                r["mma_packed_grid_us"], "p/tri", r["packed_vs_triton"], "best/bf16", r["best_mma_vs_bf16"], "err",
                r["mma_packed_rel_err"])))
        return out
    d = json.loads(text)
    out = [f"copy TB/s {d['copy_TBps']}"]
    for r in d["results"]:
        v = " ".join(f"{k}={x['us']}us/{x['weight_frac_copy']}/{x['speedup_vs_bf16']}x" for k, x in r.items()
                     if isinstance(x, dict))
        out.append(f"{r['shape']} {r['fmt']} {r['tok_per_expert']} bf16 {r['bf16_us']} triton {r['triton_us']} {v}")
    return out


if __name__ == "__main__":
    print("\n".join(lines(sys.argv[1])))
