#!/usr/bin/env bash
# Session 44's device calls (carrying .whl and build/old), from the repo root on the device box:
#   bash benchmarks/sessions/device_s44.sh <call> [args]; results under $OUT, copied to benchmarks/results/s44/.
# .whl: ../shared/tools/gpu-wheels.sh megatron-core==0.16.1 mbridge==0.15.1 einops psutil hydra-core==1.3.2
#   omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 transformers==5.24.0 six pydantic==2.14.4 pydantic_core==2.50.5
#   annotated_types typing_inspection
# build/old: the code before this session's changes (4e1e036's megatron_trace) with this session's benchmarks:
#   mkdir -p build/old && git archive 4e1e036 megatron_trace | tar -x -C build/old
#   cp -r benchmarks build/old/ && rm -rf build/old/benchmarks/{results,sessions}
#   (bench_qat_step.py puts its own tree first on sys.path, so build/old/benchmarks runs the old package)
#   ab N..   the training step, old and new code alternating per run (session 40's series plus --prechecked: the
#            guided step with records whose scales were checked before it, as the guidance cache's are)
#   check    GPU correctness of this session's changes: the dequantize kernel's exact redo bounded by the live
#            rows (the Triton kernels' files that dequantize) and scales_ok on CUDA
#   gaps     one run of the new code with --gaps and --host-profile (where the guided step's extra time goes)
# The calls (code at 936317a; head.txt names the device's stale .git copy), results in benchmarks/results/s44/:
#   call 1 (asked nvidia-h200, an H100 came), call1_ab/: BUDGET=540 bash benchmarks/sessions/device_s44.sh ab 1 2 3 4 5
#   call 2 (the same warm H100), call2_check_ab_gaps/: check (timed out at 240 s, 64% through, no failure; call 3
#     reran all of it), then BUDGET=330 ... ab 6 7 8 9 10 11 12, then gaps
#   call 3 (the same warm H100), call3_suite/: source benchmarks/_device_env.sh; python3 -m pytest -q
#     tests/guidance/test_records.py -k scales_ok; TEST_TIMEOUT=520 bash benchmarks/device_tests.sh
#   call 4 (asked nvidia-h200, a fresh H100 came; code at f8321fe, the audits' merges: no change on this path),
#     call4_ab/: BUDGET=200 bash benchmarks/sessions/device_s44.sh ab 13 14 15 16 17 (stopped after run 15)
#   call 5 (a fresh H100; carrying .whl and build/megatron-lm, made as megatron_lm_runs.sh says, with `patch -p1`:
#     `git apply` inside this repository's ignored build/ skips every path), call5_megatron_lm/:
#     TIMEOUT=200 bash benchmarks/sessions/megatron_lm_runs.sh eval_fp4
source benchmarks/sessions/_step_series.sh
ab() {
    for run in "$@"; do
        for tree in new old; do
            if (( SECONDS + 90 > ${BUDGET:-560} )); then echo "stop before run $run $tree at ${SECONDS}s"; return; fi
            dir=.; [[ $tree == old ]] && dir=build/old
            timeout 120 python3 "$dir/benchmarks/bench_qat_step.py" "${STEP[@]}" 2>> "$OUT/ab.err" \
                | sed "s/^{/{\"run\": $run, \"tree\": \"$tree\", /" >> "$OUT/ab.jsonl"
            echo "run $run $tree rc=${PIPESTATUS[0]} at ${SECONDS}s"
        done
    done
}
check() {
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs tests/kernels/test_quant_triton.py \
        tests/kernels/test_dispatch.py tests/kernels/test_layout.py tests/kernels/test_moe_triton.py \
        tests/kernels/test_moe_reference.py tests/kernels/test_rollout_finite.py tests/kernels/test_kv_write.py \
        tests/guidance/test_records.py > "$OUT/pytest_check.txt" 2>&1
    echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_check.txt" | head; tail -1 "$OUT/pytest_check.txt"
}
gaps() {
    timeout 200 python3 benchmarks/bench_qat_step.py "${STEP[@]}" --gaps --host-profile 2>> "$OUT/gaps.err" \
        >> "$OUT/gaps.jsonl"
    echo "gaps rc=$? at ${SECONDS}s"
}
"${1:?name a call: ab, check or gaps}" "${@:2}"
