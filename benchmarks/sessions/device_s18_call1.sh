#!/usr/bin/env bash
# Session 18, call 1: the whole bench_quant.py at this session's kernels (guided compact: record bit tested in
# place, bf16 pairs by one byte permute, d1/d3 by one cvt, clamped-row loads and two groups per loop trip; quantize +
# record: code words with signs by byte permutes, the record's bits from them, whole blocks per thread), then all of
# test_quant_triton.py, then the training step (guided vs plain QAT vs BF16) at the Qwen3-30B-A3B layer shape.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 90 python3 benchmarks/bench_quant.py > "$OUT/quant_all.json" 2> "$OUT/quant.err"; cat "$OUT/quant.err"
timeout 280 python3 -m pytest -q -p no:cacheprovider -n 14 --maxfail=20 -rf --tb=short \
    tests/kernels/test_quant_triton.py > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
timeout 170 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual > "$OUT/qat_step.json" 2> "$OUT/qat_step.err"
tail -3 "$OUT/qat_step.err"; tail -c 700 "$OUT/qat_step.json"
OPS="quantize_nvfp4_row+record,guided_compact+dequant(fake-quant fwd),copy"
for v in "pair_guided.programs_per_sm=12" "pair_guided.programs_per_sm=0" "pair.num_warps=2"; do
    timeout 40 python3 benchmarks/bench_quant.py --ops "$OPS" --set "$v" > "$OUT/quant_${v//[.=]/_}.json" \
        2> "$OUT/quant.err"; echo "== $v"; cat "$OUT/quant.err"
done
