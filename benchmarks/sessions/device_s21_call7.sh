#!/usr/bin/env bash
# Session 21, call 7: the step-time goal figures under the alternating round order (_timing.interleaved_ms), three
# runs of the three variants (no +stack variants).
source benchmarks/_device_env.sh > /dev/null 2>&1
for i in 1 2 3; do
  timeout 120 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
      --kernels auto --warmup 2 --reps 10 --gc manual > "$OUT/qat_step_$i.json" 2>> "$OUT/err.txt"
  python3 -c "import json; d=json.load(open('$OUT/qat_step_$i.json')); print(d['step_ms']); print(d['round_ratio_median'])"
done
gzip "$OUT/err.txt"
