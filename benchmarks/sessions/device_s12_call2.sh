#!/usr/bin/env bash
# Session 12, call 2: the decode attention's per-row intervals (starts / lengths, HFRolloutBackend.generate's
# interval masks): GPU tests (bit-equal to the same rows as a kv_mask), the per-layer micro-benchmark with masks,
# and end to end with left-padded rows (--left-pad 0.5) reading the mask (words) vs the intervals, compiled layers.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 -rf --tb=short tests/gpu/test_kv_attention_gpu.py \
    tests/kernels/test_kv_attention.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -30
timeout 90 python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8192,32768 --alt --mask \
    > "$OUT/decode_attn_mask.jsonl" 2> "$OUT/decode_attn_mask.err"; tail -2 "$OUT/decode_attn_mask.err"
python3 benchmarks/summarize_rows.py fast "$OUT/decode_attn_mask.jsonl"
for m in words interval; do
    TORCHDYNAMO_DISABLE=0 timeout 150 python3 benchmarks/bench_decode.py --modes fp4f --batches 8,64 \
        --lengths 8192,32768 --left-pad 0.5 --masks $m --no-graph --profile --profile-top 40 --compile layers \
        --budget-s 110 --out "$OUT/decode_pad_$m.jsonl" > /dev/null 2> "$OUT/decode_pad_$m.err"
    tail -2 "$OUT/decode_pad_$m.err"
    python3 benchmarks/summarize_rows.py decode "$OUT/decode_pad_$m.jsonl"
done
