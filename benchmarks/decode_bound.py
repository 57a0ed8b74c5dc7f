"""How far FP4 decode can get from BF16 on this GPU: the measured step with its expert GEMM and attention replaced by
their bytes at a fraction of the copy bandwidth (an Amdahl bound from ``bench_decode.py --profile`` rows).

For each (batch, context) with profiled bf16 and FP4 rows: the FP4 step is split into expert GEMM, attention,
activation quantize and the rest (``plot_step_breakdown.split``: transformers' dense GEMMs, norms, RoPE, router,
routing; identical work in both modes). The bound keeps the rest and the quantize as measured and prices the expert
weights (NVFP4: 4.5 bits per weight) and the FP4 K/V history (codes, block scales, per-row amax) at ``--fraction``
of ``--copy-tb-s``. Experts read per step: the expected distinct experts of ``batch`` tokens choosing top-k of E
uniformly, E (1 - (1 - k/E)^batch); a random-weight router is close to uniform. Prints one JSON line per point:
    python3 benchmarks/decode_bound.py RESULTS.jsonl [--copy-tb-s 4.25] [--fraction 1.0] [--fp4-mode fp4f]
"""

from __future__ import annotations

import argparse
import json

from plot_step_breakdown import split

NVFP4_BYTES_PER_WEIGHT = 4.5 / 8  # E2M1 codes + one e4m3 scale per 16 weights


def expected_experts(batch: int, experts: int, top_k: int) -> float:
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


def kv_bytes(dims: dict, batch: int, context: int) -> float:
    """FP4 K and V history of every layer: codes (D/2), e4m3 block scales (D/16) and a float32 amax per row."""
    d = dims["head_dim"]
    rows = batch * dims["num_key_value_heads"] * context * dims["num_hidden_layers"]
    return 2 * rows * (d / 2 + d / 16 + 4)


def weight_bytes(dims: dict, batch: int) -> float:
    e = expected_experts(batch, dims["num_experts"], dims["num_experts_per_tok"])
    per_expert = 3 * dims["hidden_size"] * dims["moe_intermediate_size"]  # gate, up, down
    return e * per_expert * dims["num_hidden_layers"] * NVFP4_BYTES_PER_WEIGHT


def bounds(rows: list[dict], copy_tb_s: float, fraction: float, fp4_mode: str) -> list[dict]:
    """One bound per (batch, context) with profiled bf16 and ``fp4_mode`` rows; ValueError where there is none (or
    no ``decode_setup`` row with the model's dims), naming the profiled (mode, batch, context) points found."""
    dims = next((r["model"] for r in rows if r.get("bench") == "decode_setup"), None)
    if dims is None:
        raise ValueError("no decode_setup row (the model's dims): RESULTS.jsonl must be bench_decode.py output")
    prof = {(r["mode"], r["batch"], r["context"]): r for r in rows
            if r.get("bench") == "decode" and "profile" in r and "top_kernels" in r["profile"]}
    pairs = [k for k in prof if k[0] == fp4_mode and ("bf16", *k[1:]) in prof]
    if not pairs:
        raise ValueError(f"no (batch, context) with profiled bf16 and {fp4_mode!r} rows (bench_decode.py --profile);"
                         f" profiled (mode, batch, context): {sorted(prof) or 'none'}")
    out = []
    for (mode, b, t), fp4 in sorted(prof.items(), key=lambda kv: kv[0][1:]):
        base = prof.get(("bf16", b, t))
        if mode != fp4_mode or base is None:
            continue
        parts = split(fp4)
        bw = copy_tb_s * 1e12 * fraction
        w, kv = weight_bytes(dims, b), kv_bytes(dims, b, t)
        gemm_ms, attn_ms = w / bw * 1e3, kv / bw * 1e3
        fixed = fp4["profile"]["step_ms"] - parts["expert GEMM"] - parts["attention"]
        bound = fixed + gemm_ms + attn_ms
        bf16 = base["profile"]["step_ms"]
        out.append({
            "bench": "decode_bound", "batch": b, "context": t, "bf16_ms": bf16, "fp4_ms": fp4["profile"]["step_ms"],
            "measured_x": round(bf16 / fp4["profile"]["step_ms"], 3),
            "fp4_gemm_ms": round(parts["expert GEMM"], 4), "fp4_attention_ms": round(parts["attention"], 4),
            "fp4_fixed_ms": round(fixed, 4), "experts_read": round(expected_experts(
                b, dims["num_experts"], dims["num_experts_per_tok"]) * dims["num_hidden_layers"], 1),
            "gemm_fraction_of_copy": round(w / (copy_tb_s * 1e12) / (parts["expert GEMM"] * 1e-3), 3),
            "attention_fraction_of_copy": round(kv / (copy_tb_s * 1e12) / (parts["attention"] * 1e-3), 3),
            "bound_gemm_ms": round(gemm_ms, 4), "bound_attention_ms": round(attn_ms, 4),
            "bound_fp4_ms": round(bound, 4), "bound_x": round(bf16 / bound, 3), "fraction": fraction,
            "copy_tb_s": copy_tb_s,
        })
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--copy-tb-s", type=float, default=4.25, help="measured copy bandwidth (METRICS.md: 4.2-4.3)")
    p.add_argument("--fraction", type=float, default=1.0, help="of the copy bandwidth the FP4 kernels would reach")
    p.add_argument("--fp4-mode", default="fp4f")
    a = p.parse_args(argv)
    rows = [json.loads(line) for line in open(a.results) if line.startswith("{")]
    try:
        out = bounds(rows, a.copy_tb_s, a.fraction, a.fp4_mode)
    except ValueError as e:
        p.error(f"{a.results}: {e}")
    for row in out:
        print(json.dumps(row))
    return out


if __name__ == "__main__":
    main()
