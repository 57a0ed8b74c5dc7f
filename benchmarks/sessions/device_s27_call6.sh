#!/usr/bin/env bash
# Session 27, call 6: the wgmma GEMM's 256-token tile as one m64n256k16 per k16 step (N256=1) against two m64n128k16
# (the default), at 256 tokens per expert on Qwen3's FC1 / FC2 (errors against the reference in the JSON).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 256 --tiles 256 --no-triton \
    --variants ",N256=1" > "$OUT/bench_n256.json" 2> "$OUT/bench_n256.err"; echo "bench rc=$? after ${SECONDS}s"
tail -2 "$OUT/bench_n256.err" | cut -c1-900
