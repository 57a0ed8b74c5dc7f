# Sourced by the device scripts that time the training step (sessions 44-46): the wheels and $OUT
# (_device_env.sh), the GPU's name, session 40's bench_qat_step.py series with the +checked arm, one warm Triton cache,
# and `steps N..`: one run of the series per N (results in $OUT/steps.jsonl).
source benchmarks/_device_env.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
STEP=(--preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided --kernels auto --warmup 2 --reps 8
      --gc manual --prechecked)
export TRITON_CACHE_DIR=/tmp/triton_warm
steps() {
    for run in "$@"; do
        if (( SECONDS + 70 > ${BUDGET:-560} )); then echo "stop before run $run at ${SECONDS}s"; return; fi
        timeout 120 python3 benchmarks/bench_qat_step.py "${STEP[@]}" 2>> "$OUT/steps.err" \
            | sed "s/^{/{\"run\": $run, /" >> "$OUT/steps.jsonl"
        echo "run $run rc=${PIPESTATUS[0]} at ${SECONDS}s"
    done
}
