#!/usr/bin/env bash
# Session 10, call 5: the W4A16 GEMM's decode row with 1-2 warps per program (mma.sync instead of wgmma: no
# warpgroup waits) against the current default, device time, at 1 and 16 tokens per expert on the three shapes.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 280 python3 benchmarks/bench_moe_gemm.py --sweep --sweep-tokens 1,16 --fmts nvfp4 > "$OUT/gemm_sweep.jsonl" \
    2> "$OUT/gemm_sweep.err"
tail -3 "$OUT/gemm_sweep.err"
python3 - "$OUT/gemm_sweep.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "time_us" in r:
        print(r["shape"], r["tok_per_expert"], r["config"], r["time_us"], r["bf16_us"], r["speedup"],
              r["fp4_weight_frac_copy"], r["rel_err_vs_default"])
    elif "error" in r:
        print("ERROR", r["shape"], r["config"], r["error"][:100])
PY
