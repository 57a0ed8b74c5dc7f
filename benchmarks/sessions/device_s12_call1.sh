#!/usr/bin/env bash
# Session 12, call 1 (the session-11 call-2 plan, fitted to one 600 s call): GPU tests of the rollout and the grouped
# experts path (the gather-based default path, the compiled routing / row plumbing and compile="layers" included);
# end-to-end decode with HFRolloutBackend(compile="layers" and "modules") at batch 8 / 64 and 8K / 32K, profiled.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 6 -rf --tb=short tests/gpu/test_rollout_gpu.py \
    tests/gpu/test_kv_attention_gpu.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -30
for c in layers modules; do
    TORCHDYNAMO_DISABLE=0 timeout 180 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 \
        --lengths 8192,32768 --profile --profile-top 40 --compile $c --budget-s 130 \
        --out "$OUT/decode_compile_$c.jsonl" > /dev/null 2> "$OUT/decode_compile_$c.err"
    tail -3 "$OUT/decode_compile_$c.err"
    python3 benchmarks/summarize_rows.py decode "$OUT/decode_compile_$c.jsonl"
done
