#!/usr/bin/env bash
# Session 27, call 10: the GPU tests whose case builders moved into tests/gpu/_common.py (grouped_gemm_case,
# experts_case): the two CUDA GEMMs' and the experts paths'.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu/test_moe_wgmma_gpu.py \
    tests/gpu/test_moe_mma_gpu.py tests/gpu/test_kv_attention_gpu.py -k "not attention" > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
