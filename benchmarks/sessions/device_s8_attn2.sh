#!/usr/bin/env bash
# Session 8, second and third calls: the FP4-KV attention with uint32 scale words (cp.async-pipelined) and wave-aware splits
# (``fast_splits``): GPU tests (MXFP4 16-token tiles now expected to work where scales load as words), the launch
# config sweep of bench_decode_attn.py in device time, Nsight Compute speed of light, then end-to-end decode.
source benchmarks/_device_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_kv_attention.py \
    tests/gpu/test_kv_attention_gpu.py 2>&1 | tail -3
python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8192,32768 > "$OUT/attn.jsonl" 2> "$OUT/attn.err"
tail -3 "$OUT/attn.err"
python3 benchmarks/summarize_rows.py attn "$OUT/attn.jsonl"
ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel --section SpeedOfLight \
    --section Occupancy python3 benchmarks/ncu_kernels.py --ops attn > "$OUT/attn_ncu.txt" 2> "$OUT/ncu.err" \
    || tail -3 "$OUT/ncu.err"
grep -E "^  [a-z]|Duration|DRAM Throughput|Theoretical Occ" "$OUT/attn_ncu.txt" | cut -c1-110
timeout 230 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 --lengths 8192 --no-graph --profile \
    --budget-s 150 --out "$OUT/decode.jsonl" > "$OUT/decode.out" 2> "$OUT/decode.err"
tail -2 "$OUT/decode.err"
python3 benchmarks/summarize_rows.py decode "$OUT/decode.jsonl"
