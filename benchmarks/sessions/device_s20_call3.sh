#!/usr/bin/env bash
# Session 20, call 3: where the training step leaves the GPU idle (BF16 / plain FP4 QAT / TRACE guided, Qwen3-30B-A3B
# layer shape, one micro-batch): one step per variant profiled between syncs (_gaps.idle_gaps: idle total, the gaps
# by the host op that launched the next kernel) and the host syncs by source line.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 300 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 4 --gc manual --gaps --profile-top 25 --sync-sites > "$OUT/qat_step_gaps.json" \
    2> "$OUT/qat_step.err"
grep -v Warning "$OUT/qat_step.err" | tail -4
python3 - "$OUT/qat_step_gaps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["step_ms"])
for k, g in d["gaps"].items():
    print("==", k, {x: g[x] for x in ("span_ms", "busy_ms", "idle_ms", "gaps_over_min_ms", "host_late_ms")})
    for row in g["by_launching_op"][:12]:
        print("   ", row)
for k, s in d.get("sync_sites", {}).items():
    print("== syncs", k, s["total"], s["by_site"][:8])
PY
