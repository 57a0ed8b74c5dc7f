#!/usr/bin/env bash
# Session 27, call 8: after moving the two CUDA GEMMs' operand preparation into shared helpers
# (moe_mma.launch_operands / weight_operands): the GPU tests of every GEMM path, the dispatch and the rollout experts.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu/test_moe_wgmma_gpu.py \
    tests/gpu/test_moe_mma_gpu.py tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py \
    tests/kernels/test_moe_triton.py tests/kernels/test_moe_mma.py tests/kernels/test_moe_wgmma.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
gzip -f "$OUT/pytest.txt"
