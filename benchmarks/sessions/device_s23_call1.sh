#!/usr/bin/env bash
# Session 23, call 1: the experts' weights quantized as their MoE layer starts (experts.prepare_weights, hooked by
# find_trace_layers) against after the dispatcher's host sync (+late, as before): the Megatron GPU tests, the
# training step four times (alternating round order, every variant with and without), then one step's GPU gaps.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_megatron_gpu.py \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"; gzip "$OUT/pytest.txt"
for i in 1 2 3 4; do
  timeout 100 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
      --kernels auto --warmup 2 --reps 8 --gc manual --late-weights > "$OUT/qat_step_$i.json" 2>> "$OUT/err.txt"
  python3 benchmarks/step_summary.py "$OUT/qat_step_$i.json"
  [ "$SECONDS" -gt 430 ] && break
done
left=$((570 - SECONDS))
[ "$left" -gt 60 ] && timeout "$left" python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b \
    --variants bf16_grouped,fp4_qat,trace_guided --kernels auto --warmup 2 --reps 3 --gc manual --late-weights --gaps \
    > "$OUT/qat_step_gaps.json" 2>> "$OUT/err.txt" && python3 benchmarks/step_summary.py "$OUT/qat_step_gaps.json"
gzip "$OUT/err.txt"
