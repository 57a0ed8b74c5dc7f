#!/usr/bin/env bash
# Session 30, call 9: call 8's cProfile counted 81K Python calls in the FP4 generate against 45K in BF16 (batch 8,
# 2048-token prompts, 1 new token): the same profile with the top 80 functions by calls. Then the combine's and
# rollout's GPU tests at the final code.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 120 python3 benchmarks/profile_host.py --batch 8 --prompt 2048 --tokens 1 --top 80 > "$OUT/host_b8.jsonl" \
    2> "$OUT/host_b8.err"
echo "rc=$?"; tail -2 "$OUT/host_b8.err"
python3 - "$OUT/host_b8.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["mode"], "wall", r["walls_ms"], "profiled", r["profiled_ms"], "calls", r["calls"])
    for row in r["by_calls"][:60]:
        print("  n", row)
PY
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_moe_combine_gpu.py \
    tests/gpu/test_rollout_gpu.py -k "combine or experts or static or generate or compiled" 2>&1 | tail -4
