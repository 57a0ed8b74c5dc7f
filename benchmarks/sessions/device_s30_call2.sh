#!/usr/bin/env bash
# Session 30, call 2: call 1 found the fast FP4-KV attention's one-warp 64-token tile (64, 1, 2) 14-26% faster than
# the default (32, 1, 3) at 32 query / 4 KV heads. The tiles over batch 1 / 8 / 64 and 1K / 8K / 32K context at both
# head counts the benchmarks use (16 / 4 and 32 / 4 of 128), with the lazy rescale (slack 8); then (64, 1, 2) with
# slack 0 at two points.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
show() {
    python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r.get("heads"), r.get("batch"), r.get("context"), {k[:-3]: v for k, v in r.items() if k.endswith("_us")
                                                             and k.startswith(("bf16", "fused_fast", "fast_"))})
PY
}
for heads in 32,4,128 16,4,128; do
    timeout 200 python3 benchmarks/bench_decode_attn.py --heads $heads --batches 1,8,64 --lengths 1024,8192,32768 \
        --alt 64,1,2,0 64,1,3,0 64,2,2,0 128,2,2,0 > "$OUT/attn_${heads//,/_}.jsonl" 2> "$OUT/attn.err"
    echo "heads=$heads rc=$?"; tail -2 "$OUT/attn.err"; show "$OUT/attn_${heads//,/_}.jsonl"
done
timeout 60 python3 benchmarks/bench_decode_attn.py --heads 32,4,128 --batches 8,64 --lengths 32768 --alt 64,1,2,0 \
    --slack 0 > "$OUT/attn_32_4_128_slack0.jsonl" 2> "$OUT/attn.err"; echo "slack0 rc=$?"
show "$OUT/attn_32_4_128_slack0.jsonl"
