#!/usr/bin/env bash
# Session 31, call 5: every GPU test at the final code (tests/gpu and tests/kernels), as benchmarks/device_tests.sh.
TEST_TIMEOUT=540 bash benchmarks/device_tests.sh
