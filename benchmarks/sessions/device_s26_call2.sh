#!/usr/bin/env bash
# Session 26, call 2: the CUDA GEMM on weights in moe_mma.pack's layout (each warp load 512 contiguous bytes, one
# scale load per step): its GPU tests (same bits as the plain layout), then the plain and packed layouts timed side
# by side, with and without dequantization, NVFP4 and MXFP4, Qwen3's FC1 and FC2.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_mma_gpu.py tests/kernels/test_moe_mma.py \
    > "$OUT/pytest_moe_mma.txt" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/pytest_moe_mma.txt"
for fmt in nvfp4 mxfp4; do
  timeout 200 python3 benchmarks/bench_moe_mma.py --fmt $fmt --tokens 1,4,8,16 --variants ,SKIP_DEQUANT=1 --packed \
      > "$OUT/moe_mma_packed_$fmt.json" 2> "$OUT/moe_mma_packed_${fmt}_err.txt"; echo "bench $fmt rc=$?"
  python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_packed_$fmt.json"
done
