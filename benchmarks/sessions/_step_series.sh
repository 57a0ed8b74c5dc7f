# Sourced by the device scripts that time the training step (sessions 44-45): the wheels and $OUT
# (_device_env.sh), the GPU's name, session 40's bench_qat_step.py series with the +checked arm, one warm Triton cache.
source benchmarks/_device_env.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
STEP=(--preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided --kernels auto --warmup 2 --reps 8
      --gc manual --prechecked)
export TRITON_CACHE_DIR=/tmp/triton_warm
