"""One short line per JSON row of ``bench_decode_attn.py``, ``bench_decode.py`` or ``bench_moe_skew.py`` output, for
device-call logs.

``python3 benchmarks/summarize_rows.py attn FILE.jsonl`` (times of every kernel, the fast kernel's ratios),
``... fast FILE.jsonl`` (the fast kernel's variants: masks, intervals, readable rows, launch configs) or
``... decode FILE.jsonl`` (GPU ms per step, attention and MoE ms, eager tokens/s per mode, batch and context) or
``... skew FILE.jsonl`` (the GEMM's default launch and its times per variant, BT 32-128 left out) or
``... wgmma FILE.json`` (``bench_moe_wgmma.py``: per shape, format and tokens per expert, the bf16 time and each
kernel's time, speedup and error).
"""

from __future__ import annotations

import argparse
import json

ATTN_KEYS = ("batch", "context", "timers", "error", "fused_fast_us", "fused_fast_over_bf16", "fused_fast_frac_copy",
             "fast_rel_err_fp32", "fast_config")


def attn(row: dict) -> str:
    keep = {k: v for k, v in row.items() if (k.endswith("_us") and not k.startswith("fused_")) or k in ATTN_KEYS}
    return json.dumps(keep)


def fast(row: dict) -> str:
    return f"{row.get('batch')} {row.get('context')} " + json.dumps(
        {k: v for k, v in row.items() if k.endswith("_us") and "fast" in k})


def decode(row: dict) -> str | None:
    if row.get("bench") != "decode":
        return None
    p = row.get("profile", {})
    return (f"{row['mode']} {row['batch']} {row['context']} step_ms {p.get('step_ms')} attn_kernels_ms "
            f"{p.get('attn_kernels_ms')} moe_ms {p.get('moe_ms')} kernels {p.get('kernels_per_step')} graph_ms "
            f"{row.get('graph_ms')} eager_tok_s {row.get('eager_tok_s')} "
            f"{row.get('error', '')}")


def skew(row: dict) -> str | None:
    if row.get("bench") != "moe_skew":
        return None
    times = {k[:-3]: v for k, v in row.items() if k.endswith("_us") and not k.startswith(("bt32", "bt64", "bt128"))}
    return (f"{row['shape']} {row['batch']} {row['active_experts']} default {row['default_k_slices']} "
            f"{row['default_programs']} {times}")


def wgmma(row: dict) -> str | None:
    if row.get("bench") != "moe_wgmma":
        return None
    return "\n".join(f"{r['shape']} {r['fmt']} {r['tok_per_expert']} bf16 {r['bf16_us']} " + str(
        {k: (v["us"], v["speedup_vs_bf16"], v.get("rel_err")) for k, v in r.items() if isinstance(v, dict)})
        for r in row["results"])


FORMATS = {"attn": attn, "fast": fast, "decode": decode, "skew": skew, "wgmma": wgmma}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=tuple(FORMATS))
    p.add_argument("path", metavar="FILE.jsonl")
    a = p.parse_args(argv)
    kind, path = a.kind, a.path
    fmt = FORMATS[kind]
    for line in open(path):
        out = fmt(json.loads(line))
        if out:
            print(out)


if __name__ == "__main__":
    main()
