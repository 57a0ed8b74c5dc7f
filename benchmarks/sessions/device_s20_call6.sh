#!/usr/bin/env bash
# Session 20, call 6: after the ready-point fixes (a persistent pinned buffer per device; a counter's zeroing
# marks it), fewer launches per given-amax check, and MXFP4 quantize of bf16 by packed bf16x2 pairs
# (quant_mx_triton): all GPU tests of tests/gpu and test_kv_write.py plus the deferred-check and MXFP4 cases of
# test_quant_triton.py; MXFP4 quantize timed (and its index path); host microseconds per fake-quant call; the
# training step, also with the stream drained before the check (+drain: the old read) in the same rounds.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 280 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short tests/gpu \
    tests/kernels/test_kv_write.py tests/kernels/test_quant_triton.py -k "not test_quant_triton or deferred or given or mxfp4" \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"
timeout 60 python3 benchmarks/bench_quant.py --ops "quantize_mxfp4,dequantize_mxfp4,copy" > "$OUT/quant_mxfp4.json" \
    2> "$OUT/quant.err"
grep -v "_checked\|deferred" "$OUT/quant.err"
timeout 60 python3 benchmarks/bench_host_overhead.py > "$OUT/host_overhead.json" 2> "$OUT/host_overhead.err"
grep -v Warning "$OUT/host_overhead.err" | tail -6
timeout 240 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual --drain --gaps --profile-top 40 > "$OUT/qat_step_gaps.json" \
    2> "$OUT/qat_step.err"
python3 - "$OUT/qat_step_gaps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["step_ms"], d["round_ratio_median"])
for k, g in d["gaps"].items():
    print("==", k, {x: g[x] for x in ("span_ms", "busy_ms", "idle_ms", "gaps_over_min_ms", "host_late_ms")})
PY
