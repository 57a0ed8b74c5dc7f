#!/usr/bin/env bash
# Session 27, call 9: the rollout's experts forward on the wgmma GEMM at prefill sizes (ExpertWeightStore's "wgmma"
# copy, experts.PREFILL_WGMMA): the GPU tests of the experts paths and the wgmma GEMM, then the experts forward of a
# Qwen3-30B-A3B-shaped layer at 2048-8192 prompt tokens, Triton GEMM against wgmma.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs --tb=short tests/gpu/test_kv_attention_gpu.py \
    tests/gpu/test_moe_wgmma_gpu.py tests/rollout/test_packed_weight_store.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
timeout 120 python3 benchmarks/bench_prefill_experts.py --tokens 2048,4096,8192 > "$OUT/bench_prefill.json" \
    2> "$OUT/bench_prefill.err"; echo "bench rc=$? after ${SECONDS}s"; tail -4 "$OUT/bench_prefill.err" | cut -c1-600
