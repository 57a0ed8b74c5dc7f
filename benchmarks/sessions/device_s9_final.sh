#!/usr/bin/env bash
# Session 9, last call: GPU tests of the changed kernels at the final code (GEMM: EVEN_N, register caps, settled
# join_k, new 64/128 rows; attention: one-warp defaults for head_dim 32/64/128) and the rollout; then end-to-end
# decode at batch 8 / 64 and 8K / 32K (2.07B random-weight Qwen3-MoE) with the new attention default.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=line tests/kernels/test_moe_triton.py \
    tests/kernels/test_kv_attention.py tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py 2>&1 \
    | grep -E "passed|failed|FAILED|Error" | head -10
timeout 220 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 --lengths 8192,32768 --no-graph \
    --profile --budget-s 170 --out "$OUT/decode.jsonl" > "$OUT/decode.out" 2> "$OUT/decode.err"
tail -2 "$OUT/decode.err"
python3 benchmarks/summarize_rows.py decode "$OUT/decode.jsonl"
