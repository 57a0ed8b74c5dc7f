#!/usr/bin/env bash
# Session 20, call 1: the training step profiled per variant (BF16 / plain FP4 QAT / TRACE guided at the
# Qwen3-30B-A3B layer shape, one micro-batch: GPU busy time, kernel counts, the top 60 ops), then this session's
# kernels: MXFP4 quantize without the tile-wide Inf check (33 registers instead of 56), guided -> codes as code
# words, and launch configs of both.
source benchmarks/_device_env.sh > /dev/null 2>&1
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 300 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 6 --gc manual --profile --profile-top 60 > "$OUT/qat_step_profile.json" \
    2> "$OUT/qat_step.err"
tail -3 "$OUT/qat_step.err"
timeout 60 python3 benchmarks/bench_quant.py --ops "quantize_mxfp4,guided,copy" > "$OUT/quant.json" 2> "$OUT/quant.err"
grep -v "_checked\|deferred" "$OUT/quant.err"
for v in "pair_mxfp4.num_warps=1" "pair_mxfp4.num_warps=4" "pair_mxfp4.tile=8192" "pair_mxfp4.tile=2048"; do
    timeout 30 python3 benchmarks/bench_quant.py --ops "quantize_mxfp4,copy" --set "$v" \
        > "$OUT/quant_${v//[.=]/_}.json" 2> "$OUT/quant.err"; echo "== $v"; grep -v "_checked\|deferred" "$OUT/quant.err"
done
timeout 40 python3 benchmarks/bench_quant.py --ops "guided,copy" --set "pair_guided.num_warps=2" \
    > "$OUT/quant_guided_2warps.json" 2> "$OUT/quant.err"; echo "== guided 2 warps"; grep -v "_checked" "$OUT/quant.err"
