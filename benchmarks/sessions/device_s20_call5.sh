#!/usr/bin/env bash
# Session 20, call 5: the deferred NaN/Inf check and the guided step's exit read after their producers only
# (checks.ReadyPoint: a side stream waits for the counting kernels, the GPU is not drained before the optimizer):
# its GPU tests and the Megatron GPU tests, then the training step (timing + GPU idle gaps).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 --maxfail=20 -rf --tb=short tests/gpu/test_checks_gpu.py \
    tests/gpu/test_megatron_gpu.py tests/kernels/test_quant_triton.py -k "checks or megatron or deferred" \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"
timeout 300 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual --gaps --profile-top 40 > "$OUT/qat_step_gaps.json" \
    2> "$OUT/qat_step.err"
python3 - "$OUT/qat_step_gaps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["step_ms"], d["round_ratio_median"])
for k, g in d["gaps"].items():
    print("==", k, {x: g[x] for x in ("span_ms", "busy_ms", "idle_ms", "gaps_over_min_ms", "host_late_ms")})
    for row in g["by_launching_op"][:6]:
        print("   ", row)
PY
