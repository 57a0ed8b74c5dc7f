#!/usr/bin/env bash
# Session 24, call 3: the CUDA GEMM with L2 prefetches PREFETCH steps ahead and packed NVFP4 scale conversion; its
# tests; prefetch distances and the no-dequantization build against Triton and bf16 (Qwen3-30B-A3B shapes).
# (As run: the PREFETCH macro (L2 prefetches) was removed after this call, since it was slower.)
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 150 python3 -m pytest -q tests/gpu/test_moe_mma_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest.txt"
timeout 330 python3 benchmarks/bench_moe_mma.py --tokens 1,4,8,16 \
    --variants ,PREFETCH=0,PREFETCH=2,PREFETCH=8,SKIP_DEQUANT=1 > "$OUT/moe_mma.json" 2> "$OUT/moe_mma_err.txt"
echo "bench rc=$?"; grep -v Warning "$OUT/moe_mma_err.txt" | tail -12
