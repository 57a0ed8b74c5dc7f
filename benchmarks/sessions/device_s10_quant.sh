#!/usr/bin/env bash
# Session 10, call 1: the quantize kernels' GPU tests (bit-exact against the CPU reference; the guided compact tile
# now rounds by directed fp32 additions on the GPU and reads whole blocks per thread), then bench_quant.py.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 120 python3 benchmarks/bench_quant.py > "$OUT/quant.jsonl" 2> "$OUT/quant.err"; tail -30 "$OUT/quant.err"
timeout 330 python3 -m pytest -q -p no:cacheprovider -n 12 -rf --tb=line tests/kernels/test_quant_triton.py 2>&1 \
    | grep -E "passed|failed|FAILED|Error" | head -30
