#!/usr/bin/env bash
# Not run in session 23 (refused); run in session 24 as part of device_s24_call7.sh (results/s24/call7).
# Session 23, call 5: is the guided step's bimodality (113-118 vs 122-128 ms) the benchmark's own doing? Per-round
# step times and the caching allocator's retries / cudaMalloc counts, with the three models resident, then with
# only the two FP4 models.
source benchmarks/_device_env.sh > /dev/null 2>&1
run() {  # name variants timeout
  timeout "$3" python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants "$2" --kernels auto \
      --warmup 2 --reps 10 --gc manual > "$OUT/qat_step_$1.json" 2>> "$OUT/err.txt"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1][-20:], d['step_ms'], \
d['cuda_memory']); [print('  ', k, v) for k, v in d['step_ms_rounds'].items()]" "$OUT/qat_step_$1.json"
}
run three bf16_grouped,fp4_qat,trace_guided 95
run two fp4_qat,trace_guided 80
gzip "$OUT/err.txt"
