#!/usr/bin/env bash
# Session 23, call 3: more runs of call 1's A/B (the experts' weights prepared as the MoE layer starts, against
# +late), training step only, alternating round order.
source benchmarks/_device_env.sh > /dev/null 2>&1
for i in 1 2 3 4 5; do
  timeout 100 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
      --kernels auto --warmup 2 --reps 8 --gc manual --late-weights > "$OUT/qat_step_$i.json" 2>> "$OUT/err.txt"
  python3 benchmarks/step_summary.py "$OUT/qat_step_$i.json"
  [ "$SECONDS" -gt 330 ] && break
done
gzip "$OUT/err.txt"
