#!/usr/bin/env bash
# Session 26, call 9: DeepSeek-V3's FC1 shape (256 experts, K = 7168: 8-token passes, one grid row per expert since
# the balanced split's cost prefix does not fit beside 8 token rows) on the plain and the packed layout.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 250 python3 benchmarks/bench_moe_mma.py --shapes dsv3_fc1 --tokens 1,4,16 --variants "" --packed \
    > "$OUT/moe_mma_dsv3.json" 2> "$OUT/moe_mma_dsv3_err.txt"; echo "bench dsv3 rc=$?"
python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_dsv3.json"
