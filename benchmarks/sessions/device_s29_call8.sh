#!/usr/bin/env bash
# Session 29, call 8: call 4's generate commands again at the final code (DENSE_FROM, and the graph captured after
# the first decode step): 2048-token prompts x 16 new tokens at batch 8 and 32, 1024 x 256 at batch 32.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 150 python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 2048 --steps 2 --no-graph \
    --generate-batches 8,32 --gen-prompt 2048 --gen-tokens 16 --gen-reps 3 --gen-dense-off --budget-s 120 \
    --out "$OUT/generate.jsonl" > "$OUT/generate.log" 2>&1; echo "bench rc=$? after ${SECONDS}s"
grep decode_generate "$OUT/generate.jsonl" | cut -c1-400
timeout 110 python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 1024 --steps 2 --no-graph \
    --generate-batches 32 --gen-prompt 1024 --gen-tokens 256 --gen-reps 2 --budget-s 90 \
    --out "$OUT/generate_long.jsonl" > "$OUT/generate_long.log" 2>&1; echo "bench rc=$? after ${SECONDS}s"
grep decode_generate "$OUT/generate_long.jsonl" | cut -c1-400
