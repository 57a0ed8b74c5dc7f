#!/usr/bin/env bash
# Session 33, call 1: every GPU test at the session's final code (the audit's GPU-path fixes, sessions 31-32's
# untested commits): tests/gpu and tests/kernels, 16 workers (carry .whl).
bash benchmarks/device_tests.sh
