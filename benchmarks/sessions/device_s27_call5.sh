#!/usr/bin/env bash
# Session 27, call 5: fp4_grouped_mm's dispatch to the wgmma GEMM (packed= in its layout, gemm="wgmma"): the GPU tests
# of the GEMMs (wgmma, mma, Triton, the rollout's experts); then the wgmma GEMM at 192 tokens per expert (between the
# measured tiles) and in MXFP4 at 128 / 256 on Qwen3's FC1 / FC2.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu/test_moe_wgmma_gpu.py \
    tests/gpu/test_moe_mma_gpu.py tests/gpu/test_kv_attention_gpu.py tests/kernels/test_moe_triton.py \
    tests/kernels/test_moe_mma.py tests/kernels/test_moe_wgmma.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
gzip -f "$OUT/pytest.txt"
timeout 120 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 192 --no-triton \
    > "$OUT/bench_192.json" 2> "$OUT/bench_192.err"; echo "bench 192 rc=$? after ${SECONDS}s"
timeout 150 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 128,256 --fmt mxfp4 \
    > "$OUT/bench_mx.json" 2> "$OUT/bench_mx.err"; echo "bench mxfp4 rc=$? after ${SECONDS}s"
tail -2 "$OUT/bench_192.err" | cut -c1-900; tail -4 "$OUT/bench_mx.err" | cut -c1-900
