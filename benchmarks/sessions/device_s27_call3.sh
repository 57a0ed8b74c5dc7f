#!/usr/bin/env bash
# Session 27, call 3: the wgmma GEMM with its token tiles loaded by TMA (call 2's cp.async needed a proxy fence, a
# MEMBAR that waited for the weight loads in flight) and NaN scale bytes zeroed before conversion: its GPU tests, then
# 64 and 256 tokens per expert on Qwen3's FC1 / FC2.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_moe_wgmma_gpu.py \
    > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? after ${SECONDS}s"
grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest.txt" | head -20; tail -2 "$OUT/pytest.txt"
timeout 300 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 64,256 --no-triton \
    --variants ",SKIP_DEQUANT=1" > "$OUT/bench_wgmma.json" 2> "$OUT/bench_wgmma.err"; echo "bench rc=$? after ${SECONDS}s"
tail -5 "$OUT/bench_wgmma.err" | cut -c1-1500
