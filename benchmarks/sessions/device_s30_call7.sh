#!/usr/bin/env bash
# Session 30, call 7: call 6's prefill walls were longer than session 29's on another machine (FP4 188-204 ms against
# 140, BF16 119-122 against 110) though the GPU time fell 11 ms: the combine A/B on one machine. profile_prefill with
# the combine kernel (bf16, fp4) and with the PyTorch ops (bf16_torch_combine, torch_combine:
# fp4_moe.COMBINE_KERNEL False), batch 8 and 32, 2048-token prompts, 1 new token.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
for b in 8 32; do
    timeout 250 python3 benchmarks/profile_prefill.py --batch $b --prompt 2048 --tokens 1 --top 20 --reps 5 \
        --variants bf16,bf16_torch_combine,fp4,torch_combine > "$OUT/prefill_b$b.jsonl" 2> "$OUT/prefill_b$b.log"
    echo "b$b rc=$? after ${SECONDS}s"; tail -1 "$OUT/prefill_b$b.log"
    python3 - "$OUT/prefill_b$b.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    i = r["idle"]
    print(r["variant"], r["batch"], "wall", r["walls_ms"], "gpu", r["gpu_ms"], "span", i.get("span_ms"), "idle",
          i.get("idle_ms"), r["kinds_ms"])
PY
done
