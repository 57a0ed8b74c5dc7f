#!/usr/bin/env bash
# Session 9, call 6: hunt the GEMM test's sporadic 3% error (n192, per-row NVFP4, Triton-ops dequant): repeated
# launches and references must give identical bits (4 workers on the GPU at once, as in the failing runs), then
# test_matches_reference five times over.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rf --tb=line tests/kernels/test_moe_triton.py \
    -k "repeated" 2>&1 | grep -E "passed|failed|FAILED|launches|Error" | head -16
for i in 1 2 3 4 5; do
  timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=line tests/kernels/test_moe_triton.py \
      -k "matches_reference" 2>&1 | grep -E "passed|failed|FAILED|Error" | head -6
done
