#!/usr/bin/env bash
# Session 9, call 2: the W4A16 GEMM with EVEN_N (no row masks when N % BN == 0) and register caps (config's 7th
# element): its GPU tests, then the decode sweep (1 / 4 / 16 tokens per expert, device time); the attention's new
# head_dim-64 default (32, 1, 2) and head_dim-32 candidates; the training step's profile (where QAT's time goes).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_moe_triton.py \
    "tests/gpu/test_kv_attention_gpu.py::test_fast_launch_configs" 2>&1 | tail -3
timeout 280 python3 benchmarks/bench_moe_gemm.py --sweep --sweep-tokens 1,4,16 > "$OUT/gemm_sweep.jsonl" 2> "$OUT/gemm.err"
tail -3 "$OUT/gemm.err"; tail -1 "$OUT/gemm_sweep.jsonl"
python3 benchmarks/bench_decode_attn.py --heads 16,4,64 --batches 8,64 --lengths 8192 --alt 64,2,2,0 32,1,3,0 \
    > "$OUT/attn64.jsonl" 2> "$OUT/attn.err"
python3 benchmarks/bench_decode_attn.py --heads 16,4,32 --batches 8,64 --lengths 8192 --alt 32,1,2,0 64,1,2,0 32,1,3,0 \
    > "$OUT/attn32.jsonl" 2>> "$OUT/attn.err"; tail -2 "$OUT/attn.err"
for f in attn64 attn32; do python3 benchmarks/summarize_rows.py attn "$OUT/$f.jsonl"; done
