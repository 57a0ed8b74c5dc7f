#!/usr/bin/env bash
# Session 13, call 3: why BF16's decode is slower than its kernels (eager and CUDA-graph replay 4-19x the profiled
# GPU time, since session 3): the same BF16 points with each SDPA backend; then the guidance capture share of
# generate with the K/V sites recorded from the cache's stored history.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
for be in default flash efficient cudnn; do
    TORCHDYNAMO_DISABLE=0 timeout 75 python3 benchmarks/bench_decode.py --modes bf16 --batches 8,64 --lengths 8192 \
        --profile --profile-top 12 --compile layers --sdpa-backend $be --budget-s 60 \
        --out "$OUT/decode_sdpa_$be.jsonl" > /dev/null 2> "$OUT/decode_sdpa_$be.err"
    echo "== sdpa $be"; tail -1 "$OUT/decode_sdpa_$be.err"; python3 benchmarks/summarize_rows.py decode "$OUT/decode_sdpa_$be.jsonl"
done
timeout 200 python3 benchmarks/bench_decode.py --modes fp4f --batches 8 --lengths 1024 --no-graph \
    --generate-batches 8,64 --gen-reps 5 --out "$OUT/capture.jsonl" > /dev/null 2> "$OUT/capture.err"
tail -2 "$OUT/capture.err"; grep decode_generate "$OUT/capture.jsonl" | cut -c1-400
