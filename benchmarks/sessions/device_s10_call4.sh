#!/usr/bin/env bash
# Session 10, call 4: the quantize kernels' GPU tests at the new pair config (2048 elements per program, 4 warps)
# and the FMA-pipe dequantization of the RNE tile; bench_quant.py at the new and the old config; the training step.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 16 -rf --tb=line tests/kernels/test_quant_triton.py 2>&1 \
    | grep -E "passed|failed|FAILED" | head -30
for cfg in "2048 4" "4096 4"; do
    set -- $cfg
    timeout 100 python3 benchmarks/bench_quant.py --tile $1 --warps $2 > "$OUT/quant_$1_$2.jsonl" 2> "$OUT/quant_$1_$2.err"
    echo "tile $1 warps $2"; grep -v "^ " "$OUT/quant_$1_$2.err" | cut -c1-130
done
timeout 150 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual > "$OUT/qat_step.json" 2> "$OUT/qat_step.err"
tail -5 "$OUT/qat_step.err"; tail -c 1500 "$OUT/qat_step.json"
