#!/usr/bin/env bash
# Session 24, call 4: the CUDA GEMM with each CTA streaming several 256-row blocks in one pipeline (about one wave of
# CTAs); its tests; against Triton and bf16 at the Qwen3-30B-A3B and DeepSeek-V3 shapes, NVFP4 and MXFP4.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 150 python3 -m pytest -q tests/gpu/test_moe_mma_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest.txt"
timeout 200 python3 benchmarks/bench_moe_mma.py --tokens 1,2,4,8,16,32 --variants ,SKIP_DEQUANT=1 \
    > "$OUT/moe_mma.json" 2> "$OUT/moe_mma_err.txt"; echo "bench rc=$?"
timeout 120 python3 benchmarks/bench_moe_mma.py --tokens 1,4,16 --fmt mxfp4 --variants "" \
    > "$OUT/moe_mma_mx.json" 2> "$OUT/moe_mma_mx_err.txt"; echo "bench mx rc=$?"
timeout 120 python3 benchmarks/bench_moe_mma.py --shapes dsv3_fc1 --tokens 1,4,16 --variants "" \
    > "$OUT/moe_mma_dsv3.json" 2> "$OUT/moe_mma_dsv3_err.txt"; echo "bench dsv3 rc=$?"
for f in moe_mma moe_mma_mx moe_mma_dsv3; do python3 - "$OUT/$f.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    v = {k: (x["us"], x["weight_frac_copy"], x["speedup_vs_bf16"]) for k, x in r.items() if isinstance(x, dict)}
    print(r["shape"], r["fmt"], r["tok_per_expert"], "bf16", r["bf16_us"], "triton", r["triton_us"],
          r["triton_weight_frac_copy"], v)
PY
done
