#!/usr/bin/env bash
# Session 22, call 3: after expert_weights.of (the experts' weight list from the module registries) and the
# map-based layout check of expert_weights.stacked: Megatron's GPU tests, host time per call, then the training
# step six times (alternating round order) for the step-time goals' spread.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_megatron_gpu.py \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"; gzip "$OUT/pytest.txt"
timeout 90 python3 benchmarks/bench_host_overhead.py --calls 1000 \
    --cprofile "expert_weights.stacked (128; with gradient)" > "$OUT/host_overhead.json" 2> "$OUT/err.txt"
grep us/call "$OUT/err.txt"
for i in 1 2 3 4 5 6; do
  timeout 115 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
      --kernels auto --warmup 2 --reps 10 --gc manual > "$OUT/qat_step_$i.json" 2>> "$OUT/err.txt"
  python3 benchmarks/step_summary.py "$OUT/qat_step_$i.json"
done
gzip "$OUT/err.txt"
