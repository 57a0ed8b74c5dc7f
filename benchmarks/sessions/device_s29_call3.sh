#!/usr/bin/env bash
# Session 29, call 3: the prefill profile with the device's idle gaps and the launching ops' shapes (BF16 against FP4
# with experts.DENSE_FROM), batch 8 and 32, 2048-token prompts, 1 new token; wall = median of 3 unprofiled generates.
source benchmarks/_device_env.sh > /dev/null 2>&1
for b in 8 32; do
  timeout 200 python3 benchmarks/profile_prefill.py --batch $b --prompt 2048 --tokens 1 --top 30 \
      --variants bf16,fp4,nocap > "$OUT/prefill_b$b.jsonl" 2> "$OUT/prefill_b$b.log"
  echo "b$b rc=$? after ${SECONDS}s"
  python3 -c "
import json
for l in open('$OUT/prefill_b$b.jsonl'):
    r=json.loads(l); i=r['idle']
    print(r['variant'], r['batch'], 'wall', r['walls_ms'], 'gpu', r['gpu_ms'], 'span', i.get('span_ms'), 'idle', i.get('idle_ms'), 'late', i.get('host_late_ms'))
"
done
