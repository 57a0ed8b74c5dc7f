#!/usr/bin/env bash
# Session 6's last H200 call (< 200 s): the guidance capture share of generate() after a full-length warm-up each way
# (no Triton compile inside a timed call), 7 interleaved rounds, automatic GC:
#   python3 benchmarks/bench_decode.py --modes fp4 --batches 8 --lengths 1024 --no-graph --steps 2 \
#     --generate-batches 8,64 --gen-tokens 64 --gen-reps 7
# Needs the wheels in ./.whl (carry .whl). -> $OUT/capture.jsonl
set -uo pipefail
source benchmarks/_device_env.sh
timeout 180 python3 benchmarks/bench_decode.py --modes fp4 --batches 8 --lengths 1024 --no-graph --steps 2 \
  --generate-batches 8,64 --gen-tokens 64 --gen-reps 7 > "$OUT/capture.jsonl" 2> "$OUT/capture.log"
echo "capture rc=$? after ${SECONDS}s"; grep decode_generate "$OUT/capture.jsonl" | cut -c1-700
