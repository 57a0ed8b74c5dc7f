#!/usr/bin/env bash
# Session 26, call 10: DeepSeek-V3's FC1 under random top-8 routing (256 experts, K = 7168: 8-token passes): where
# does the packed CUDA GEMM beat the Triton kernel (moe_mma.preferred excludes K > 3600 so far)?
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 300 python3 benchmarks/bench_moe_mma_routing.py --shapes dsv3_fc1 --batches 1,4,16,32,64,128,256 \
    > "$OUT/moe_mma_routing_dsv3.jsonl" 2> "$OUT/moe_mma_routing_dsv3_err.txt"; echo "routing dsv3 rc=$?"
python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_routing_dsv3.jsonl"
