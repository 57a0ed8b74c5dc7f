#!/usr/bin/env bash
# Session 17, call 5: the other users of the changed pair kernel on the GPU: the FP4 KV cache's writes (RNE with a
# computed row amax: the tile-wide Inf check is now skipped on the GPU) and the rollout / Megatron QAT paths, i.e.
# every test under tests/gpu/ and tests/kernels/test_kv_write.py.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 230 python3 -m pytest -q -p no:cacheprovider -n 14 -rf --tb=line tests/kernels/test_kv_write.py tests/gpu/ \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
