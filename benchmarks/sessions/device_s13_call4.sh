#!/usr/bin/env bash
# Session 13, call 4: where generate's host time goes now (cProfile, batch 8, 32 new tokens), BF16 and FP4.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 240 python3 benchmarks/profile_generate.py --modes bf16,fp4 --batch 8 --tokens 32 --top 60 \
    > "$OUT/profile_generate.jsonl" 2> "$OUT/profile_generate.err"
tail -2 "$OUT/profile_generate.err"; cut -c1-300 "$OUT/profile_generate.jsonl"
