#!/usr/bin/env bash
# Session 16, call 2: dequantize with the exact redo inside the pair kernel (one launch; call 1's profile had the
# redo launch, which only reads flags, at 12 us of 58): its GPU tests, then bench_quant's dequantize ops as they
# are and with a register cap of 32 for NVFP4 (the redo's branch took it from 32 to 40 registers); MXFP4 to bf16
# now takes the per-block table path on the GPU, 36 registers);
# the GEMM's BN 64 tile with K slices at batch 4-16 (bench_moe_skew.py, new bn64_bt16_k{2,4} columns); the guided
# compact tile with a register cap; then the decode curve at the points session 15 did not run (1K and 32K context,
# batch 1 / 8 / 64) with session 15's GEMM launch.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/kernels/test_quant_triton.py \
    -k "dequant or bit_exact or edge" 2>&1 | tail -4
for caps in "" "32"; do
    timeout 45 python3 benchmarks/bench_quant.py --ops dequantize,copy --dequant-max-registers "$caps" \
        > "$OUT/quant_dequant_caps${caps:+_${caps/,/_}}.json" 2> "$OUT/quant.err"; echo "caps=$caps"; cat "$OUT/quant.err"
done
timeout 90 python3 benchmarks/bench_moe_skew.py --shapes qwen3_fc1,qwen3_fc2 --batches 4,8,16 \
    > "$OUT/moe_skew.jsonl" 2> "$OUT/moe_skew.err"; tail -1 "$OUT/moe_skew.err"
python3 benchmarks/summarize_rows.py skew "$OUT/moe_skew.jsonl"
python3 - "$OUT/moe_skew.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("bench") != "moe_skew":  # (as run, without this line: a KeyError on the summary line at the end)
        continue
    print(r["shape"], r["batch"], "default", r["default_us"], {k: v for k, v in r.items() if k.startswith("bn64")})
PY
# the guided compact tile (the trainer's fake-quant forward, 72 registers: 7 programs per multiprocessor, its
# warps waiting on loads in call 1's profile) capped at 64 registers (8 programs; 32 bytes spilled)
for cap in 0 64; do
    timeout 40 python3 benchmarks/bench_quant.py --ops guided_compact,copy --pair-max-registers $cap \
        > "$OUT/quant_guided_cap$cap.json" 2> "$OUT/quant.err"; echo "pair cap=$cap"; cat "$OUT/quant.err"
done
export TORCHDYNAMO_DISABLE=0
timeout 200 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 1,8,64 \
    --prompts 1024,32768 --steps 24 --compile layers --graph-only > "$OUT/decode_curve.jsonl" 2> "$OUT/decode_curve.err"
tail -2 "$OUT/decode_curve.err"; cut -c1-220 "$OUT/decode_curve.jsonl"
