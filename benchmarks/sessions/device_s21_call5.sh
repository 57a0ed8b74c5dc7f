#!/usr/bin/env bash
# Session 21, call 5: why plain QAT is 2-3% slower with the packed expert weights (call 4): one profiled step of
# fp4_qat and fp4_qat+stack (device time by op), then the same-run timing once more.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants fp4_qat,bf16_grouped \
    --kernels auto --warmup 2 --reps 8 --gc manual --stack-copy --profile --profile-top 40 > "$OUT/qat_step.json" \
    2>> "$OUT/err.txt"
python3 - "$OUT/qat_step.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["step_ms"]); print(d["round_ratio_median"])
pa, pb = d["profile"]["fp4_qat[auto]"], d["profile"]["fp4_qat+stack[auto]"]
print("self total", pa["self_time_ms_total"], pb["self_time_ms_total"])
a = {k: (ms, n) for k, ms, n in pa["top_ops_ms"]}; b = {k: (ms, n) for k, ms, n in pb["top_ops_ms"]}
for k in sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, (0, 0))[0] - b.get(k, (0, 0))[0]))[:16]:
    print(f"{a.get(k, ('-', '-'))!s:>16} {b.get(k, ('-', '-'))!s:>16}  {k}")
PY
gzip "$OUT/err.txt"
