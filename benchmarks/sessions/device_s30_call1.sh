#!/usr/bin/env bash
# Session 30, call 1: the FP4-KV decode attention's lazy rescale (kv_attention_plan.RESCALE_SLACK = 8: the running
# max kept until a row's max grows by more than 8 in log2 units; 0 = rescale at every tile, the kernel as before
# apart from the branch). Its GPU tests, then bench_decode_attn at the decode curve model's heads (32 query / 4 KV
# of 128) with slack 8 and 0, and alternative tiles; head_dim 32 (its default tile went from 12 to 8 programs per
# multiprocessor) with both slacks.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/kernels/test_kv_attention.py \
    tests/gpu/test_kv_attention_gpu.py 2>&1 | tail -4
for slack in 8 0; do
    timeout 120 python3 benchmarks/bench_decode_attn.py --heads 32,4,128 --batches 8,64 --lengths 8192,32768 \
        --alt 64,1,2,0 32,1,2,0 --slack $slack > "$OUT/attn_d128_slack$slack.jsonl" 2> "$OUT/attn.err"
    echo "slack=$slack rc=$?"; tail -2 "$OUT/attn.err"
    python3 - "$OUT/attn_d128_slack$slack.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r.get("batch"), r.get("context"), {k: v for k, v in r.items() if k.endswith("_us") or k.endswith("_frac_copy")
                                             or k in ("fast_rel_err_fp32",)})
PY
done
for slack in 8 0; do
    timeout 60 python3 benchmarks/bench_decode_attn.py --heads 16,4,32 --batches 64 --lengths 8192 --alt \
        --slack $slack > "$OUT/attn_d32_slack$slack.jsonl" 2> "$OUT/attn.err"; echo "d32 slack=$slack rc=$?"
    cut -c1-600 "$OUT/attn_d32_slack$slack.jsonl"
done
