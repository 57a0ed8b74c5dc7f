#!/usr/bin/env bash
# Session 22, call 4: every GPU test of the repo (tests/gpu and tests/kernels, with the CUDA cases) in one call,
# 16 workers, verbose (node ids of what ran, in case the time limit cuts it).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 430 python3 -m pytest -v -p no:cacheprovider -n 16 -rfE --tb=short tests/gpu tests/kernels > "$OUT/pytest.txt" 2>&1
echo "rc=$?"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
grep -cE " PASSED " "$OUT/pytest.txt"; grep -cE " SKIPPED " "$OUT/pytest.txt"; gzip "$OUT/pytest.txt"
