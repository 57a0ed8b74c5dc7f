#!/usr/bin/env bash
# Session 16, call 4 (run inline on the warm machine after call 3): every GPU test under tests/gpu/ (the rollout,
# the KV write and attention, Megatron, routing), which dequantize through the changed kernel.
source benchmarks/_device_env.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=line tests/gpu/ 2>&1 \
    | grep -E "passed|failed|FAILED|Error" | head -20
