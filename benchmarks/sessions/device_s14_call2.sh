#!/usr/bin/env bash
# Session 14, call 2: the dense decode attention (static caches' BF16 layers): its GPU tests and the static-decode
# GPU tests (BF16 steps now on it), its launch configs against SDPA and the FP4 kernel, then the static decode loop
# (eager vs graph) at the Qwen3-30B-A3B shape.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 -rf --tb=short tests/gpu/test_kv_attention_gpu.py \
    tests/kernels/test_kv_attention_dense.py tests/gpu/test_rollout_gpu.py -k "dense or static" \
    2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
timeout 150 python3 benchmarks/bench_dense_attn.py > "$OUT/dense_attn.jsonl" 2> "$OUT/dense_attn.err"
tail -2 "$OUT/dense_attn.err"; python3 - "$OUT/dense_attn.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["bench"] != "dense_attn":
        print(line.strip()); continue
    keys = ["sdpa", "sdpa_masked", "dense", "fp4_fast", r["best_dense"]]
    print(r["heads"], r["batch"], r["context"], r["dense_rel_err"],
          " ".join(f"{k}={r.get(k + '_us')}us/{r.get(k + '_frac_copy')}" for k in keys))
PY
for p in 1024 8192; do
    timeout 170 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 8,64 \
        --prompt $p --steps 48 >> "$OUT/static_decode.jsonl" 2> "$OUT/static_decode_$p.err"; tail -1 "$OUT/static_decode_$p.err"
done
cut -c1-260 "$OUT/static_decode.jsonl"
