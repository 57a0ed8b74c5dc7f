#!/usr/bin/env bash
# Session 29, call 2: (1) the prefill profile again, with experts.DENSE_FROM (new: prefill-sized expert GEMMs on the
# dequantized weights) against the FP4 codes (dense_off: Triton; wgmma); the Python lines that launch the GPU time.
# (2) the experts forward at 64-2048 tokens per expert: Triton / wgmma / bf16 weights (where DENSE_FROM should sit).
# (3) cProfile of the generate's host time, BF16 against FP4, at batch 8 x 2048-token prompts.
source benchmarks/_device_env.sh > /dev/null 2>&1
for b in 8 32; do
  timeout 200 python3 benchmarks/profile_prefill.py --batch $b --prompt 2048 --tokens 1 --top 40 \
      --variants bf16,fp4,dense_off,wgmma > "$OUT/prefill_b$b.jsonl" 2> "$OUT/prefill_b$b.log"
  echo "b$b rc=$? after ${SECONDS}s"
  python3 -c "
import json
for l in open('$OUT/prefill_b$b.jsonl'):
    r=json.loads(l); print(r['variant'], r['batch'], 'wall', r['wall_ms'], 'gpu', r['gpu_ms'], r['kinds_ms'])
"
done
timeout 200 python3 benchmarks/bench_prefill_experts.py --tokens 1024,1280,1536,2048,2560,3072,4096,8192,16384 \
    > "$OUT/prefill_experts.json" 2> "$OUT/prefill_experts.log"; echo "experts rc=$? after ${SECONDS}s"
grep '^{"tokens' "$OUT/prefill_experts.log" | cut -c1-260
timeout 150 python3 benchmarks/profile_generate.py --modes bf16,fp4 --batch 8 --prompt 2048 --tokens 1 --top 30 \
    > "$OUT/host_b8.jsonl" 2> "$OUT/host_b8.log"; echo "host rc=$? after ${SECONDS}s"
