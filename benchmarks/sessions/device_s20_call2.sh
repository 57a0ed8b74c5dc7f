#!/usr/bin/env bash
# Session 20, call 2: GPU tests of this session's kernels: test_triton_fp4.py and all of test_quant_triton.py
# (the pair kernel's step restructured: MXFP4 without the exact redo unless checked; guided codes as words).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 330 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short \
    tests/kernels/test_triton_fp4.py tests/kernels/test_quant_triton.py > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
