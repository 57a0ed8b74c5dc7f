#!/usr/bin/env bash
# Session 9, call 7: the join_k GEMM with its MMAs settled at the end of each K step (triton-lang/triton#9433:
# Triton 3.6 let the next step's dequantization overwrite the registers of MMAs still in flight): repeated
# launches must give identical bits, the reference tests three times, then the large-token sweep again.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
for i in 1 2 3; do
  timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 -rf --tb=line tests/kernels/test_moe_triton.py 2>&1 \
      | grep -E "passed|failed|FAILED|launches|Error" | head -8
done
timeout 200 python3 benchmarks/bench_moe_gemm.py --sweep --sweep-tokens 64,256 > "$OUT/gemm_big.jsonl" 2> "$OUT/gemm.err"
tail -2 "$OUT/gemm.err"; tail -1 "$OUT/gemm_big.jsonl"
