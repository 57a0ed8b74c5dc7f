#!/usr/bin/env bash
# Session 11, call 1: the rollout GPU tests (with HFRolloutBackend(compile=True)); end-to-end decode at batch 8 / 64,
# 8K context, eager (host loop), CUDA graph and profiled, without and with the compiled RMSNorms and routers.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 -rf --tb=short tests/gpu/test_rollout_gpu.py 2>&1 \
    | grep -E "passed|failed|FAILED|assert" | head -20
for c in "" "--compile"; do
    dyn=1; [ -n "$c" ] && dyn=0  # --compile needs torch.compile on (_device_env.sh turns it off)
    TORCHDYNAMO_DISABLE=$dyn timeout 200 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 \
        --lengths 8192 --profile --profile-top 40 $c --budget-s 160 --out "$OUT/decode${c:+_compile}.jsonl" > /dev/null 2> "$OUT/decode${c}.err"
    tail -2 "$OUT/decode${c}.err"
    python3 benchmarks/summarize_rows.py decode "$OUT/decode${c:+_compile}.jsonl"
done
