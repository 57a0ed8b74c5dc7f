#!/usr/bin/env bash
# Session 9, call 4: head_dim-128 attention with one warp per program (no cross-warp softmax reductions: no
# barriers in the tile loop; sm_90 build: 255 registers, 8 programs per multiprocessor) against the (128, 4, 3, 128)
# default; the GEMM tests twice (one failure in call 2 did not repeat in call 3).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8192,32768 --alt 32,1,2,0 32,1,3,0 64,1,2,0 16,1,3,0 \
    > "$OUT/attn128.jsonl" 2> "$OUT/attn.err"; tail -2 "$OUT/attn.err"
python3 benchmarks/summarize_rows.py attn "$OUT/attn128.jsonl"
for i in 1 2; do
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 --tb=line tests/kernels/test_moe_triton.py 2>&1 \
      | grep -E "passed|failed|Error|assert" | head -8
done
