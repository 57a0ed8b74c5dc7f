#!/usr/bin/env bash
# Session 8, last calls: GPU tests of every kernel changed this session (FP4-KV attention: word-wise scale loads,
# the operand-width boundary, exp2 softmax, wave-aware splits, default (128, 4, 3) capped at 128 registers; RNE
# fake-quant and quantize + record by fp32 magnitudes), bench_quant.py (both RNE tiles), the attention sweep in
# device time, and end-to-end decode at batch 8 / 64 and 8K / 32K.
source benchmarks/_device_env.sh
timeout 280 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_quant_triton.py tests/kernels/test_kv_attention.py \
    tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py 2>&1 | tail -4
python3 benchmarks/bench_quant.py > "$OUT/quant.json" 2> "$OUT/quant.err"; tail -22 "$OUT/quant.err"
python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8192,32768 > "$OUT/attn.jsonl" 2> "$OUT/attn.err"
tail -3 "$OUT/attn.err"
python3 benchmarks/summarize_rows.py attn "$OUT/attn.jsonl"
timeout 200 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 --lengths 8192,32768 --no-graph \
    --profile --budget-s 150 --out "$OUT/decode.jsonl" > "$OUT/decode.out" 2> "$OUT/decode.err"
tail -2 "$OUT/decode.err"
python3 benchmarks/summarize_rows.py decode "$OUT/decode.jsonl"
