#!/usr/bin/env bash
# Session 26, call 12: after call 11's kernel (the balanced split's experts one per thread) and moe_mma.preferred
# over 32 rows to half a token pass per expert (8-token-pass shapes included): the GPU tests that reach the CUDA
# GEMM (its own, the rollout's experts and decode paths, the Triton GEMM's). The full suite ran in call 7.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu/test_moe_mma_gpu.py \
    tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py tests/kernels/test_moe_mma.py \
    tests/kernels/test_moe_triton.py > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? after ${SECONDS}s"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
gzip -f "$OUT/pytest.txt"
