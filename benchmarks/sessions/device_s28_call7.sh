#!/usr/bin/env bash
# Session 28, call 7: where fp4_grouped_mm should start running the wgmma GEMM (MIN_TOKENS_PER_EXPERT, 128 so far;
# call 6: the Triton kernel faster at 64 tokens per expert, the wgmma GEMM at 96). Qwen3's FC1 / FC2 at 64, 72, 80, 96
# tokens per expert (the same on every expert), and the rollout's experts forward at 1024, 1280, 1536 prompt tokens
# (64, 80, 96 per expert on average, random top-8 routing).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 120 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 64,72,80,96 --tiles 128 \
    > "$OUT/bench_small.json" 2> "$OUT/bench_small.err"; echo "bench small rc=$? after ${SECONDS}s"
timeout 100 python3 benchmarks/bench_prefill_experts.py --tokens 1024,1280,1536 > "$OUT/bench_prefill.json" \
    2> "$OUT/bench_prefill.err"; echo "bench prefill rc=$? after ${SECONDS}s"
python3 benchmarks/summarize_rows.py wgmma "$OUT/bench_small.json"
tail -3 "$OUT/bench_prefill.err" | cut -c1-600
