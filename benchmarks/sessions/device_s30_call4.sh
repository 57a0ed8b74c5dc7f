#!/usr/bin/env bash
# Session 30, call 4 (the lazy rescale reverted: the kernel as before this session). Call 3 showed the split plan
# matters more than the build: with the plan's 9 programs per multiprocessor the default tile chose 9 splits at
# batch 64 / 32K (2304 programs) and took 528 us against 467 with 4 (1024 programs). The fast kernel's time
# against its split count (bench_attn_splits.py) at both head counts, batch 1 / 8 / 64, 8K and 32K.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 300 python3 benchmarks/bench_attn_splits.py > "$OUT/attn_splits.jsonl" 2> "$OUT/attn_splits.err"
echo "rc=$?"; tail -2 "$OUT/attn_splits.err"
python3 - "$OUT/attn_splits.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["heads"], r["batch"], r["context"], "planned", r["planned"], "best", r["best"], r["planned_over_best"], r["us"])
PY
