#!/usr/bin/env bash
# Every GPU test of the repository in one call: tests/gpu and tests/kernels (their CUDA cases; the two-GPU tests
# skip with a reason on one GPU), 16 workers. About 450-510 s on one H200 (sessions 22-28), so the run gets 575 s;
# past that it is interrupted (SIGINT), and pytest still writes its summary.
# Run from the repo root on the GPU box with the wheels in ./.whl (carry .whl): bash benchmarks/device_tests.sh
#   -> $OUT/pytest.txt.gz (verbose: the node id and outcome of every test; the 60 slowest at its end)
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout -s INT -k 15 "${TEST_TIMEOUT:-575}" python3 -m pytest -v -p no:cacheprovider -n "${WORKERS:-16}" -rfEs --tb=short --durations=60 \
    tests/gpu tests/kernels > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
gzip -f "$OUT/pytest.txt"
