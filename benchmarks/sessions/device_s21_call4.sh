#!/usr/bin/env bash
# Session 21, call 4: same-run A/B of the packed expert weights (one [E, M, K] view per forward) against the
# stack copy of before (--stack-copy: +stack variants, expert_weights.VIEWS=False), twice; the faster view check.
source benchmarks/_device_env.sh > /dev/null 2>&1
for i in 1 2; do
  timeout 200 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
      --kernels auto --warmup 2 --reps 8 --gc manual --stack-copy > "$OUT/qat_step_$i.json" 2>> "$OUT/err.txt"
  python3 -c "import json; d=json.load(open('$OUT/qat_step_$i.json')); print(d['step_ms']); print(d['round_ratio_median'])"
done
gzip "$OUT/err.txt"
