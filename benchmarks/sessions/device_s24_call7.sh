#!/usr/bin/env bash
# Session 24, call 7: the tests the CUDA GEMM touches, with gemm="auto" back on the Triton kernel (moe_mma.AUTO off):
# the CUDA kernel's, the Triton GEMM's, the host side's, and the rollout's FP4 path; then, with the time left, session
# 23's unrun probe of the guided step's bimodality (device_s23_call5.sh: per-round step times, allocator retries).
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu/test_moe_mma_gpu.py \
    tests/kernels/test_moe_triton.py tests/kernels/test_moe_mma.py tests/gpu/test_rollout_gpu.py \
    > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? after ${SECONDS}s"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -2 "$OUT/pytest.txt"
bash benchmarks/sessions/device_s23_call5.sh
