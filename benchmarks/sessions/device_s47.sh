#!/usr/bin/env bash
# Session 47's device calls (carrying .whl), from the repo root on the device box:
#   bash benchmarks/sessions/device_s47.sh <call> [args]; results under $OUT, copied to benchmarks/results/s47/.
#   amax     where the NVFP4 per-tensor quantize's time goes (amax pass, torch max, quantize pass), and the amax
#            pass with an L2 evict-last hint and/or an atomic max (bench_amax_pass.py), 4096-32768 rows of 2048 bf16
#   amax_sweep  the amax pass (bench_amax_pass.py --sweep) over its launch choices; at 8bdddfc the kernel looped
#            over blocks (ABSMAX_PROGRAMS_PER_SM, reverted at 41e0e4d); later one block per program, as shipped
#   probe    flush, then amax_sweep, then the amax pass's GPU tests
#   flush    bench_amax_pass.py's ops and a torch copy of x after an L2 flush by writing (the benchmarks' protocol)
#            and by reading (L2 left clean)
#   suite    every GPU test (benchmarks/device_tests.sh)
source benchmarks/_device_env.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
amax() {
    for rows in ${@:-8192 32768 4096 16384}; do
        timeout 120 python3 benchmarks/bench_amax_pass.py --rows "$rows" --k 2048 \
            2>> "$OUT/amax.err" >> "$OUT/amax.jsonl"
        echo "rows $rows rc=$? at ${SECONDS}s"
    done
    cat "$OUT/amax.err"
}
amax_sweep() {
    for rows in ${@:-8192 32768 4096}; do
        timeout 150 python3 benchmarks/bench_amax_pass.py --sweep --rows "$rows" --k 2048 \
            2>> "$OUT/amax_sweep.err" >> "$OUT/amax_sweep.jsonl"
        echo "rows $rows rc=$? at ${SECONDS}s"
    done
    cat "$OUT/amax_sweep.err"
}
flush() {
    for rows in ${@:-8192 32768}; do
        timeout 150 python3 benchmarks/bench_amax_pass.py --flush-by both --rows "$rows" --k 2048 \
            2>> "$OUT/flush.err" >> "$OUT/flush.jsonl"
        echo "rows $rows rc=$? at ${SECONDS}s"
    done
    cat "$OUT/flush.err"
}
probe() {
    flush
    amax_sweep
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs tests/kernels/test_quant_triton.py \
        -k "amax or stacked" > "$OUT/pytest_amax.txt" 2>&1
    echo "pytest rc=$? at ${SECONDS}s: $(tail -1 "$OUT/pytest_amax.txt")"
}
suite() {
    TEST_TIMEOUT=${TEST_TIMEOUT:-540} bash benchmarks/device_tests.sh
}
"${1:?name a call: amax, amax_sweep, flush, probe or suite}" "${@:2}"
