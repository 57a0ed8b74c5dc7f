#!/usr/bin/env bash
# Next session, first call: the GPU tests that session 12's calls 4 and 5 cut off at their time limits (the fused
# KV write's CUDA file, the attention's readable-rows test), alone and with room; then the routing and rollout files.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short --durations=8 tests/gpu/test_kv_write_gpu.py \
    tests/gpu/test_kv_attention_gpu.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error|s call" | head -30
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_moe_routing_gpu.py \
    tests/gpu/test_rollout_gpu.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
