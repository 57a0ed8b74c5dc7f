#!/usr/bin/env bash
# Session 30, call 3: call 2's default tile (32, 1, 3) took 525 us at 16 / 4 heads, batch 64, 32K, where sessions 9
# and 12 measured 451-453. Is it the lazy rescale's build (214 registers, 9 programs per multiprocessor in the split
# plan) or this machine? On one machine: the build as before (RESCALE_SLACK = -1: the eager online softmax, no
# branch; 255 registers) with its plan (8 programs), the lazy build with 9 and with 8, and the 64-token tile with
# and without the lazy rescale.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
for heads in 16,4,128 32,4,128; do
for variant in "-1 8" "8 9" "8 8"; do
    set -- $variant
    timeout 100 python3 - "$1" "$2" "$heads" > "$OUT/attn_${heads//,/_}_slack$1_res$2.jsonl" 2> "$OUT/attn.err" <<'PY'
import sys
from megatron_trace.kernels import kv_attention_plan as plan
import bench_decode_attn
plan.FAST_RESIDENT[(128, 32, 1, 3, None)] = int(sys.argv[2])
bench_decode_attn.main(["--heads", sys.argv[3], "--batches", "8,64", "--lengths", "8192,32768", "--alt", "64,1,2,0",
                        "--slack", sys.argv[1]])
PY
    echo "heads=$heads slack=$1 resident=$2 rc=$?"; tail -1 "$OUT/attn.err"
    python3 - "$OUT/attn_${heads//,/_}_slack$1_res$2.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r.get("batch"), r.get("context"), {k[:-3]: v for k, v in r.items() if k.endswith("_us")
                                             and k.startswith(("bf16", "fused_fast", "fast_"))})
PY
done
done
