#!/usr/bin/env bash
# Session 28, call 6: the final wgmma build (persistent grid, half-width last tiles) where it was not measured yet:
# MXFP4 on Qwen3's FC1 / FC2 at 128 / 256 tokens per expert; 64 and 96 tokens per expert against the Triton kernel
# (where the dispatch starts, MIN_TOKENS_PER_EXPERT = 128); DeepSeek-V3's FC2 shape (256 experts, K 2048, N 7168) at
# 128 / 256.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 120 python3 benchmarks/bench_moe_wgmma.py --fmt mxfp4 --shapes qwen3_fc1,qwen3_fc2 --tokens 128,256 \
    > "$OUT/bench_mxfp4.json" 2> "$OUT/bench_mxfp4.err"; echo "bench mxfp4 rc=$? after ${SECONDS}s"
timeout 120 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 64,96 --tiles 128 \
    > "$OUT/bench_small.json" 2> "$OUT/bench_small.err"; echo "bench small rc=$? after ${SECONDS}s"
timeout 150 python3 benchmarks/bench_moe_wgmma.py --shapes dsv3_fc2 --tokens 128,256 --no-triton \
    > "$OUT/bench_dsv3_fc2.json" 2> "$OUT/bench_dsv3_fc2.err"; echo "bench dsv3_fc2 rc=$? after ${SECONDS}s"
python3 benchmarks/summarize_rows.py wgmma "$OUT/bench_mxfp4.json"
python3 benchmarks/summarize_rows.py wgmma "$OUT/bench_small.json"
python3 benchmarks/summarize_rows.py wgmma "$OUT/bench_dsv3_fc2.json"
tail -2 "$OUT/bench_dsv3_fc2.err" | cut -c1-400
