#!/usr/bin/env bash
# Session 20, call 7 (inline on the machine still warm from call 6, whose pytest run hit its 150 s timeout): the
# checks' GPU tests, the Megatron GPU model's, the deferred-check cases and the MXFP4 bf16 edge / unchecked-Inf
# cases of test_quant_triton.py.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 15 -rf --tb=short tests/gpu/test_checks_gpu.py \
    tests/gpu/test_megatron_gpu.py tests/kernels/test_quant_triton.py \
    -k "checks or deferred or (mxfp4 and bfloat16 and edge) or unchecked_mxfp4" > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"
