#!/usr/bin/env bash
# Session 24, call 2: the CUDA GEMM with coalesced weight loads (a quad reads 64 contiguous bytes per row); its
# tests; build variants (register budget, no dequantization) against Triton and bf16.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 120 python3 -m pytest -q tests/gpu/test_moe_mma_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest.txt"
timeout 300 python3 benchmarks/bench_moe_mma.py --tokens 1,4,8,16 > "$OUT/moe_mma.json" 2> "$OUT/moe_mma_err.txt"
echo "bench rc=$?"; grep -v Warning "$OUT/moe_mma_err.txt" | tail -12
