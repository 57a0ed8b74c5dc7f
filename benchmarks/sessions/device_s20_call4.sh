#!/usr/bin/env bash
# Session 20, call 4: host microseconds per call of the trainer's fake-quant entry points (bench_host_overhead.py,
# with cProfile of two), then the step's GPU idle gaps again (plain QAT and TRACE guided; GC off in the profiled
# step, Triton launches attributed, the activity before each gap).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 120 python3 benchmarks/bench_host_overhead.py --cprofile fake_quant_weights,guided_fake_quant_rows \
    > "$OUT/host_overhead.json" 2> "$OUT/host_overhead.err"
grep -v Warning "$OUT/host_overhead.err" | tail -8
timeout 300 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 4 --gc manual --gaps --profile-top 40 > "$OUT/qat_step_gaps.json" \
    2> "$OUT/qat_step.err"
python3 - "$OUT/qat_step_gaps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["step_ms"])
for k, g in d["gaps"].items():
    print("==", k, {x: g[x] for x in ("span_ms", "busy_ms", "idle_ms", "gaps_over_min_ms", "host_late_ms")})
    for row in g["by_launching_op"][:6]:
        print("   ", row)
PY
