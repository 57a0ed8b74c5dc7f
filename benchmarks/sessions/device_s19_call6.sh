#!/usr/bin/env bash
# Session 19, call 6: the MXFP4 cases of test_quant_triton.py at the new default launch config ("pair_mxfp4":
# 2 warps; call 3 ran them at 4).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short tests/kernels/test_quant_triton.py \
    -k mxfp4 > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"
