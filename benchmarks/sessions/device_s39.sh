# Session 39's device calls (an H100, nvidia-h100-x1, carrying .whl), in order; results in benchmarks/results/s39/callN.
# Each call ran one of these blocks from the repo root on the device machine.
call1() { bash benchmarks/device_tests.sh; }                     # at e3ea15a: every GPU test
call2() { bash benchmarks/sessions/device_s36_call2.sh; }        # the micro-batch profile (session 36's script)
call3() { git log --oneline -1 > "$OUT/head.txt"; bash benchmarks/device_tests.sh; }   # at 927a4a7
call4() {  # the experts' GPU path with no tokens (before the fix)
    source benchmarks/_device_env.sh > /dev/null 2>&1
    timeout 200 python3 benchmarks/sessions/probe_s39_empty.py 2>&1 | tail -12 | tee "$OUT/probe.jsonl"; }
call5() {  # the same after the fix, with its GPU test and the combine tests
    call4
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_rollout_gpu.py tests/gpu/test_moe_combine_gpu.py \
        -k "no_tokens or combine" 2>&1 | tail -5 | tee "$OUT/tests.txt"; }
call6() {  # the files the fix touches, whole
    source benchmarks/_device_env.sh > /dev/null 2>&1; git log --oneline -1 > "$OUT/head.txt"
    timeout 280 python3 -m pytest -q -p no:cacheprovider -n 8 tests/gpu/test_rollout_gpu.py tests/kernels/test_moe_combine.py \
        tests/gpu/test_moe_combine_gpu.py 2>&1 | tail -4 | tee "$OUT/tests.txt"; }
qat_runs() {  # the training step at the fixed round order (benchmarks/_timing.interleaved_ms): runs "$@", TIMEOUT s each
    source benchmarks/_device_env.sh > /dev/null 2>&1
    for run in "$@"; do
        timeout "${TIMEOUT:-100}" python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b \
            --variants bf16_grouped,fp4_qat,trace_guided --kernels auto --warmup 2 --reps 8 --gc manual 2>> "$OUT/qat.err" \
            | sed "s/^{/{\"run\": $run, /" >> "$OUT/qat.jsonl"
        echo "run $run rc=${PIPESTATUS[0]} at ${SECONDS}s"
    done
}
call7() { qat_runs 1 2; }                 # run 2 failed out of memory
call8() { TIMEOUT=70 qat_runs 2 3; }      # both failed out of memory, as call 7's run 2
"${1:-call1}"
