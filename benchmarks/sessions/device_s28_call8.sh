#!/usr/bin/env bash
# Session 28, call 8: every GPU test at the session's final code (the persistent wgmma grid, half-width last tiles,
# the dispatch from 64 tokens per expert): tests/gpu and tests/kernels, 16 workers.
bash benchmarks/device_tests.sh
