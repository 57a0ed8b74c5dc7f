#!/usr/bin/env bash
# Session 16, call 3: the GPU tests of the dequantize changes that call 2's 150 s cut short (the exact redo inside
# the pair kernel; MXFP4 to bf16 by the per-block table: every code at every E8M0 scale byte, subnormal and Inf /
# NaN results), then the rest of test_quant_triton.py.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/kernels/test_quant_triton.py \
    -k "every or edge or ieee" 2>&1 | grep -E "passed|failed|FAILED|Error|assert" | head -20
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 12 -rf --tb=line tests/kernels/test_quant_triton.py \
    -k "not (every or edge or ieee)" 2>&1 | grep -E "passed|failed|FAILED|Error" | head -20
