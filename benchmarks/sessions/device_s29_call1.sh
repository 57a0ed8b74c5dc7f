#!/usr/bin/env bash
# Session 29, call 1: where a prefill-heavy generate's GPU time goes, BF16 against FP4 (capture on, off, and with
# experts.PREFILL_WGMMA): the decode benchmark's ~2.1B Qwen3-MoE, 2048-token prompts, 1 new token, batch 8 and 32.
source benchmarks/_device_env.sh > /dev/null 2>&1
for b in 8 32; do
  timeout 240 python3 benchmarks/profile_prefill.py --batch $b --prompt 2048 --tokens 1 --top 40 \
      > "$OUT/prefill_b$b.jsonl" 2> "$OUT/prefill_b$b.log"; echo "b$b rc=$? after ${SECONDS}s"
  python3 -c "
import json,sys
for l in open('$OUT/prefill_b$b.jsonl'):
    r=json.loads(l); print(r['variant'], r['batch'], 'wall', r['wall_ms'], 'gpu', r['gpu_ms'], r['kinds_ms'])
"
done
