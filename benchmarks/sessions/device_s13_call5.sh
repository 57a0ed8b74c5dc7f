#!/usr/bin/env bash
# Session 13, call 5: the W4A16 GEMM under random top-8 routing (unequal tokens per expert: a token tile too small
# for the busiest expert re-reads its weights), then end to end (default model, fp4f) with the config chosen for the
# mean tokens per expert (--gemm-headroom 0, the old rule) and with the headroom default (3), and the GEMM tests.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 benchmarks/bench_moe_skew.py > "$OUT/moe_skew.jsonl" 2> "$OUT/moe_skew.err"
tail -1 "$OUT/moe_skew.err"; python3 - "$OUT/moe_skew.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["bench"] == "moe_skew":
        print(r["shape"], r["batch"], r["mean_tokens"], r["max_tokens"], "default", r["default"][2], r["default_us"],
              *(f"{c} {r[c + '_us']}" for c in ("bt16", "bt32", "bt64", "bt128")), "bf16", r["bf16_us"])
PY
for h in 0 3; do
    TORCHDYNAMO_DISABLE=0 timeout 70 python3 benchmarks/bench_decode.py --modes fp4f --batches 8,64 --lengths 8192 \
        --profile --profile-top 20 --compile layers --no-graph --gemm-headroom $h --budget-s 55 \
        --out "$OUT/decode_headroom_$h.jsonl" > /dev/null 2> "$OUT/decode_headroom_$h.err"
    echo "== headroom $h"; tail -1 "$OUT/decode_headroom_$h.err"; python3 benchmarks/summarize_rows.py decode "$OUT/decode_headroom_$h.jsonl"
done
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/kernels/test_moe_triton.py \
    2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
