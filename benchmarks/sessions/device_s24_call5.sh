#!/usr/bin/env bash
# Session 24, call 5: is the CUDA GEMM's weight stream limited by DRAM locality? Each warp step's 4 KB read as one
# contiguous block (PROBE_CONTIGUOUS, with and without dequantization) against the real layout; DeepSeek-V3's shape.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 200 python3 benchmarks/bench_moe_mma.py --tokens 1,4,16 \
    --variants ,SKIP_DEQUANT=1,PROBE_CONTIGUOUS=1,PROBE_CONTIGUOUS=1+SKIP_DEQUANT=1 \
    > "$OUT/moe_mma_probe.json" 2> "$OUT/moe_mma_probe_err.txt"; echo "bench rc=$?"
timeout 200 python3 benchmarks/bench_moe_mma.py --shapes dsv3_fc1 --tokens 1,4,16 --variants "" \
    > "$OUT/moe_mma_dsv3.json" 2> "$OUT/moe_mma_dsv3_err.txt"; echo "bench dsv3 rc=$?"
for f in moe_mma_probe moe_mma_dsv3; do python3 - "$OUT/$f.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    v = {k: (x["us"], x["weight_frac_copy"], x["speedup_vs_bf16"], x["rel_err"]) for k, x in r.items()
         if isinstance(x, dict)}
    print(r["shape"], r["fmt"], r["tok_per_expert"], "bf16", r["bf16_us"], "triton", r["triton_us"],
          r["triton_weight_frac_copy"], v)
PY
done
