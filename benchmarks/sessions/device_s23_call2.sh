#!/usr/bin/env bash
# Session 23, call 2: every GPU test of the repo in one call (benchmarks/device_tests.sh).
bash benchmarks/device_tests.sh
