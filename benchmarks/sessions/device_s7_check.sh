#!/usr/bin/env bash
# Session 7: GPU tests of the changed kernels (guided compact by magnitudes, one-launch split combine), then
# bench_quant.py (both guided tiles), bench_decode_attn.py at 8K/32K, and ncu's executed-instruction counts of the
# guided op ($OUT/src_guided.csv).
source benchmarks/_device_env.sh
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_quant_triton.py tests/kernels/test_kv_attention.py \
    tests/gpu/test_kv_attention_gpu.py 2>&1 | tail -3
python3 benchmarks/bench_quant.py > "$OUT/quant.json" 2> "$OUT/quant.err"; tail -14 "$OUT/quant.err"
python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8192,32768 > "$OUT/attn.jsonl" 2> "$OUT/attn.err"
python3 - "$OUT/attn.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r.get("batch"), r.get("context"), "bf16", r.get("bf16_us"), "fast", r.get("fused_fast_us"),
          "fast/bf16", r.get("fused_fast_over_bf16"), "frac", r.get("fused_fast_frac_copy"), r.get("error", ""))
PY
ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel --section SourceCounters \
    --page source --print-source sass --csv python3 benchmarks/ncu_kernels.py --only "guided_compact" \
    > "$OUT/src_guided.csv" 2> "$OUT/ncu.err" || tail -3 "$OUT/ncu.err"
