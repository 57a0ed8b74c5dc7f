#!/usr/bin/env bash
# Session 26, call 3: the CUDA GEMM with the next step's first half of codes loaded as soon as the current step's
# first half is used (SPLIT_LOADS=1, the source's default now) against loading the whole next step after the step
# (SPLIT_LOADS=0, call 2's build), both layouts, NVFP4 and MXFP4; the GPU tests on the new default first.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_mma_gpu.py tests/kernels/test_moe_mma.py \
    > "$OUT/pytest_moe_mma.txt" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/pytest_moe_mma.txt"
for fmt in nvfp4 mxfp4; do
  timeout 200 python3 benchmarks/bench_moe_mma.py --fmt $fmt --tokens 1,4,8,16 --variants ,SPLIT_LOADS=0 --packed \
      > "$OUT/moe_mma_split_$fmt.json" 2> "$OUT/moe_mma_split_${fmt}_err.txt"; echo "bench $fmt rc=$?"
  python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_split_$fmt.json"
done
