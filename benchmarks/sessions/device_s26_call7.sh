#!/usr/bin/env bash
# Session 26, call 7: every GPU test of the repository at the session's final kernels (moe_mma.AUTO on: the rollout's
# FP4 experts run the packed CUDA GEMM at decode sizes).
bash benchmarks/device_tests.sh
