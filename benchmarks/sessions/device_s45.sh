#!/usr/bin/env bash
# Session 45's device calls (carrying .whl and build/megatron-lm), from the repo root on the device box:
#   bash benchmarks/sessions/device_s45.sh <call> [args]; results under $OUT, copied to benchmarks/results/s45/.
# .whl and build/megatron-lm: as device_s44.sh and megatron_lm_runs.sh say.
#   overlap  Megatron-LM's pretrain_gpt.py with --trace-fp4 and the distributed optimizer, without and with
#            --overlap-param-gather (megatron_lm_runs.sh dist_fp4 overlap_fp4), then tests/gpu/test_megatron_gpu.py
#   steps N..  the training step, session 40's series (bench_qat_step.py, new code only), one run per N
#   profile    one run of the series with --profile --profile-top 60 (device time by op: the guided step's extra
#              GPU work), then megatron_lm_runs.sh eval_fp4 overlap_fp4 (the patch's new trace_eval_start)
source benchmarks/sessions/_step_series.sh
overlap() {
    TIMEOUT=150 bash benchmarks/sessions/megatron_lm_runs.sh dist_fp4 overlap_fp4
    for v in dist_fp4 overlap_fp4; do
        grep -o "lm loss: [0-9.E+-]*" "$OUT/$v.log" | awk '{print $3}' > "$OUT/$v.loss"
    done
    echo "loss curves identical: $(cmp -s "$OUT/dist_fp4.loss" "$OUT/overlap_fp4.loss" && echo yes || echo no)" \
        "($(wc -l < "$OUT/dist_fp4.loss") / $(wc -l < "$OUT/overlap_fp4.loss") iterations)"
    paste "$OUT/dist_fp4.loss" "$OUT/overlap_fp4.loss" | sed -n '1p;10p;20p;30p'
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_megatron_gpu.py \
        > "$OUT/pytest_megatron_gpu.txt" 2>&1
    echo "pytest rc=$? at ${SECONDS}s: $(tail -1 "$OUT/pytest_megatron_gpu.txt")"
}
profile() {
    timeout 200 python3 benchmarks/bench_qat_step.py "${STEP[@]}" --profile --profile-top 60 2>> "$OUT/profile.err" \
        > "$OUT/profile.jsonl"
    echo "profile rc=$? at ${SECONDS}s"
    TIMEOUT=150 bash benchmarks/sessions/megatron_lm_runs.sh eval_fp4 overlap_fp4
}
"${1:?name a call: overlap, steps or profile}" "${@:2}"
