#!/usr/bin/env bash
# Session 21, call 1: stacked expert weights fake-quantized with per-expert amaxes computed in two launches
# (quant_triton.absmax_rows; ops.fake_quantize(stacked=True)) instead of ~14 torch ops and a given per-row amax;
# session 20's untested checks tests (warmed-up read), then host time per call and the training step.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 8 --maxfail=20 -rf --tb=short tests/gpu/test_checks_gpu.py \
    tests/gpu/test_megatron_gpu.py tests/kernels/test_quant_triton.py \
    -k "checks or megatron or deferred or stacked or given" > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"; gzip "$OUT/pytest.txt"
timeout 90 python3 benchmarks/bench_host_overhead.py --cprofile fake_quant_weights,fake_quant_rows \
    > "$OUT/host_overhead.json" 2> "$OUT/host_overhead.err"; cat "$OUT/host_overhead.err" | grep us/call
timeout 300 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual --gaps --profile-top 40 > "$OUT/qat_step_gaps.json" \
    2> "$OUT/qat_step.err"
python3 - "$OUT/qat_step_gaps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["step_ms"], d["round_ratio_median"])
for k, g in d["gaps"].items():
    print("==", k, {x: g[x] for x in ("span_ms", "busy_ms", "idle_ms", "gaps_over_min_ms", "host_late_ms")})
    for row in g["by_launching_op"][:8]:
        print("   ", row)
PY
