# Session 40's device calls (asked for nvidia-h200, every one came on an H100; carrying .whl), in order; results in benchmarks/results/s40/callN.
# Each call ran one of these blocks from the repo root on the device machine.
qat_runs() {  # the training step at the fixed round order (benchmarks/_timing.interleaved_ms): runs "$@", TIMEOUT s each,
              # stopping before a run that would pass BUDGET s of the call
    source benchmarks/_device_env.sh > /dev/null 2>&1
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
    git log --oneline -1 > "$OUT/head.txt" 2>/dev/null
    for run in "$@"; do
        if (( SECONDS + ${TIMEOUT:-100} > ${BUDGET:-560} )); then echo "stop before run $run at ${SECONDS}s"; break; fi
        [[ -n "$COLD" ]] && export TRITON_CACHE_DIR="/tmp/triton_run$run"   # a cold Triton cache per run
        [[ -n "$WARM" ]] && export TRITON_CACHE_DIR="/tmp/triton_warm"      # one cache: runs after the first are warm
        timeout "${TIMEOUT:-100}" python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b \
            --variants bf16_grouped,fp4_qat,trace_guided --kernels auto --warmup 2 --reps 8 --gc manual 2>> "$OUT/qat.err" \
            | sed "s/^{/{\"run\": $run, /" >> "$OUT/qat.jsonl"
        echo "run $run rc=${PIPESTATUS[0]} at ${SECONDS}s"
    done
}
call1() { qat_runs 1 2 3 4 5 6 7 8 9 10; }  # came on an H100: run 1 passed, runs 2-10 out of memory (as session 39)
call2() { COLD=1 qat_runs 1 2 3 4 5 6 7 8 9 10 11 12; }  # the same, each run with a cold Triton cache
call3() { WARM=1 BUDGET="${BUDGET:-300}" qat_runs 1 2 3 4 5 6 7 8; }  # at the weakref fix (find_trace_layers' cycle)
# call 3 ran `BUDGET=190 call3` and call 4 `BUDGET=150 TIMEOUT=45 call3` on the same warm machine (its Triton cache
# warm from call 3), both at 156b1de (head.txt on the device names an older commit: its .git copy was stale)
[[ "${BASH_SOURCE[0]}" == "$0" ]] && "${1:-call1}"  # run a call; sourced: define qat_runs only
