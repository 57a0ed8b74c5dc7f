#!/usr/bin/env bash
# Session 9, call 9 (last 4 device minutes): the FP4-KV attention with kv_mask read as int32 words and the K/V
# loads no longer waiting for it (the rollout's decode passes a mask on every call): GPU tests of the attention,
# then the fast kernel with and without the mask (words / bytes) at batch 8 / 64 and 8K / 32K.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 80 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=line tests/kernels/test_kv_attention.py \
    tests/gpu/test_kv_attention_gpu.py 2>&1 | grep -E "passed|failed|FAILED|Error" | head -8
timeout 120 python3 benchmarks/bench_decode_attn.py --batches 64,8 --lengths 32768,8192 --alt --mask \
    > "$OUT/attn_mask.jsonl" 2> "$OUT/attn.err"; tail -2 "$OUT/attn.err"
python3 -c "
import json,sys
for l in open('$OUT/attn_mask.jsonl'):
    r=json.loads(l); print({k: r.get(k) for k in ('batch','context','bf16_us','fused_fast_us','fused_fast_mask_us','fused_fast_mask_bytes_us','error')})"
