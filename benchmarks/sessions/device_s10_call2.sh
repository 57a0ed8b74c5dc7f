#!/usr/bin/env bash
# Session 10, call 2: the quantize kernels' GPU tests after the libdevice-flush fix of the guided tile; the launch
# config sweep of the quantize ops; the attention / rollout GPU tests (mask as words, the rollout's once-per-step
# aligned mask); end-to-end decode at batch 8 / 64 and 8K / 32K.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 12 -rf --tb=line tests/kernels/test_quant_triton.py 2>&1 \
    | grep -E "passed|failed|FAILED" | head -30
timeout 150 python3 benchmarks/bench_quant.py --sweep > "$OUT/quant_sweep.jsonl" 2> "$OUT/quant_sweep.err"
tail -3 "$OUT/quant_sweep.err"
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 12 -rf --tb=line tests/kernels/test_kv_attention.py \
    tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py 2>&1 | grep -E "passed|failed|FAILED" | head -20
timeout 190 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 --lengths 8192,32768 --no-graph \
    --profile --budget-s 150 --out "$OUT/decode.jsonl" > "$OUT/decode.out" 2> "$OUT/decode.err"
tail -2 "$OUT/decode.err"
python3 benchmarks/summarize_rows.py decode "$OUT/decode.jsonl"
