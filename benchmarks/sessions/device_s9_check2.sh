#!/usr/bin/env bash
# Session 9, call 5: which GEMM configs race (40 launches each on the same inputs must give the same bits); the
# GEMM's large-token rows with and without join_k (what dropping join_k would cost); the attention's new one-warp
# defaults (head_dim 128: (32, 1, 3); 32: (64, 1, 2)) in the GPU tests and against more one-warp configs.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rf --tb=line tests/kernels/test_moe_triton.py \
    -k "repeated" 2>&1 | grep -E "passed|failed|FAILED|launches" | head -12
timeout 200 python3 benchmarks/bench_moe_gemm.py --sweep --sweep-tokens 64,256 > "$OUT/gemm_big.jsonl" 2> "$OUT/gemm.err"
tail -2 "$OUT/gemm.err"; tail -1 "$OUT/gemm_big.jsonl"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=line tests/gpu/test_kv_attention_gpu.py \
    tests/kernels/test_kv_attention.py 2>&1 | grep -E "passed|failed|FAILED" | head -8
python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8192,32768 --alt 128,4,3,128 32,1,4,0 64,1,3,0 \
    > "$OUT/attn128.jsonl" 2> "$OUT/attn.err"; tail -2 "$OUT/attn.err"
python3 benchmarks/summarize_rows.py attn "$OUT/attn128.jsonl"
