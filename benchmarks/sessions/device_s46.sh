#!/usr/bin/env bash
# Session 46's device calls (carrying .whl), from the repo root on the device box:
#   bash benchmarks/sessions/device_s46.sh <call> [args]; results under $OUT, copied to benchmarks/results/s46/.
#   quant    the NVFP4 per-tensor quantize (two passes) with the amax pass reading x from its end
#            (quant_triton.ABSMAX_LAST_FIRST, new) against from its start (as before), and the stacked weights'
#            fake-quant, at 4096-32768 rows of 2048 bf16; then the quantize kernels' GPU tests
#   quant_rev  the same two sizes' ops timed in the reverse order (an order effect in the A/B?), then every GPU test
#   steps N..  the training step, session 40's series (bench_qat_step.py), one run per N
#   suite    every GPU test (benchmarks/device_tests.sh)
source benchmarks/sessions/_step_series.sh
quant() {
    for rows in 8192 32768 4096 16384; do
        timeout 120 python3 benchmarks/bench_quant.py --rows "$rows" --k 2048 \
            --ops quantize_nvfp4_tensor,fake_quant_stacked,quantize_nvfp4_row+record \
            2>> "$OUT/quant.err" >> "$OUT/quant.jsonl"
        echo "rows $rows rc=$? at ${SECONDS}s"
    done
    timeout 240 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs tests/kernels/test_quant_triton.py \
        > "$OUT/pytest_quant.txt" 2>&1
    echo "pytest rc=$? at ${SECONDS}s: $(tail -1 "$OUT/pytest_quant.txt")"
}
quant_rev() {
    for rows in 8192 32768; do
        timeout 100 python3 -c "import sys; sys.argv = ['bench_quant.py', '--rows', '$rows', '--k', '2048',
    '--ops', 'quantize_nvfp4_tensor,fake_quant_stacked']
import bench_quant as b
cases = b.cases
b.cases = lambda *a: dict(reversed(list(cases(*a).items())))
b.main()" 2>> "$OUT/quant_rev.err" >> "$OUT/quant_rev.jsonl"
        echo "rows $rows (reverse order) rc=$? at ${SECONDS}s"
    done
    TEST_TIMEOUT=$(( 590 - SECONDS )) bash benchmarks/device_tests.sh
}
suite() {
    TEST_TIMEOUT=${TEST_TIMEOUT:-540} bash benchmarks/device_tests.sh
}
"${1:?name a call: quant, quant_rev, steps or suite}" "${@:2}"
