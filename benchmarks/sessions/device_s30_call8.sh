#!/usr/bin/env bash
# Session 30, call 8: the FP4 prefill-heavy generate is host-bound (call 7: 175-183 ms of wall for 81 ms of GPU time
# at batch 8, BF16 103-114 for 77). cProfile of one generate per mode (new profile_host.py), batch 8, 2048-token
# prompts, 1 new token: which host calls take the time.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 200 python3 benchmarks/profile_host.py --batch 8 --prompt 2048 --tokens 1 --top 30 > "$OUT/host_b8.jsonl" \
    2> "$OUT/host_b8.err"
echo "rc=$?"; tail -2 "$OUT/host_b8.err"
python3 - "$OUT/host_b8.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["mode"], "wall", r["walls_ms"], "profiled", r["profiled_ms"], "calls", r["calls"])
    for row in r["by_own_time"][:20]:
        print("  own", row)
    for row in r["by_cumulative"][:30]:
        print("  cum", row)
PY
