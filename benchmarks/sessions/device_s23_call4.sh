#!/usr/bin/env bash
# Session 23, call 4: where the guided step's host time goes, function by function with callees (raw cProfile
# dumps of one step per variant, for pstats' print_callees), at the Qwen3-30B-A3B preset.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 4 --gc manual --host-profile --host-profile-dir "$OUT" \
    > "$OUT/qat_host.json" 2> "$OUT/err.txt"
echo "rc=$?"; python3 benchmarks/step_summary.py "$OUT/qat_host.json"; gzip "$OUT/err.txt"
