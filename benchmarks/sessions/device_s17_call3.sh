#!/usr/bin/env bash
# Session 17, call 3: call 2's run of test_quant_triton.py had 141 failures (its log kept only the last lines).
# The same tests, stopping after 12 failures, with their tracebacks kept in $OUT/pytest.txt.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 280 python3 -m pytest -q -p no:cacheprovider -n 14 --maxfail=12 -rf --tb=short \
    tests/kernels/test_quant_triton.py > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -40
grep -E "^E " "$OUT/pytest.txt" | sort | uniq -c | sort -rn | head -20
tail -3 "$OUT/pytest.txt"
