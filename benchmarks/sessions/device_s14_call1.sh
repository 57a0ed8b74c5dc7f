#!/usr/bin/env bash
# Next session, first call (written in session 13, not run): the CUDA-graph replay of the fixed-buffer decode step
# (rollout.static_decode) and its GPU tests, then the decode loop's wall time eager vs replayed, and the W4A16
# GEMM under random routing with the BN 64 configs (wave quantization at few active experts).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rf --tb=short tests/gpu/test_rollout_gpu.py -k static \
    2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
timeout 200 python3 benchmarks/bench_static_decode.py --modes bf16,fp4 --batches 8,64 --prompt 1024 --steps 64 \
    > "$OUT/static_decode.jsonl" 2> "$OUT/static_decode.err"; tail -3 "$OUT/static_decode.err"; cat "$OUT/static_decode.jsonl"
timeout 150 python3 benchmarks/bench_moe_skew.py > "$OUT/moe_skew.jsonl" 2> "$OUT/moe_skew.err"
tail -1 "$OUT/moe_skew.err"; cut -c1-400 "$OUT/moe_skew.jsonl"
