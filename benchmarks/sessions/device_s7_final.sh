#!/usr/bin/env bash
# Session 7, last call: GPU tests of every kernel changed this session (quantize: guided compact by magnitudes;
# attention: one-launch combine, CUDA tolerances), then end-to-end decode, bf16 vs fp4f (fast FP4-KV attention),
# at batch 8 and 64, 8K context ($OUT/decode.jsonl).
source benchmarks/_device_env.sh
timeout 270 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_quant_triton.py tests/kernels/test_kv_attention.py \
    tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py 2>&1 | tail -4
timeout 220 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 --lengths 8192 --no-graph --profile \
    --budget-s 120 --out "$OUT/decode.jsonl" > "$OUT/decode.out" 2> "$OUT/decode.err"
tail -4 "$OUT/decode.err"; tail -c 1500 "$OUT/decode.out"
