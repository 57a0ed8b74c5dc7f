#!/usr/bin/env bash
# Session 29, call 4: a whole HFRolloutBackend.generate (product defaults: static decode auto) with the prefill-sized
# expert GEMMs on the dequantized weights (experts.DENSE_FROM, new) against the FP4 codes (--gen-dense-off), BF16
# beside it: session 28 call 9's command (2048-token prompts, 16 new tokens, batch 8 and 32), and 1024-token prompts
# with 256 new tokens at batch 32. Then the prefill profile with static decode auto (graphs) at batch 8.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 240 python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 2048 --steps 2 --no-graph \
    --generate-batches 8,32 --gen-prompt 2048 --gen-tokens 16 --gen-reps 3 --gen-dense-off --budget-s 200 \
    --out "$OUT/generate.jsonl" > "$OUT/generate.log" 2>&1; echo "bench rc=$? after ${SECONDS}s"
grep decode_generate "$OUT/generate.jsonl" | cut -c1-600
timeout 200 python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 1024 --steps 2 --no-graph \
    --generate-batches 32 --gen-prompt 1024 --gen-tokens 256 --gen-reps 2 --gen-dense-off --budget-s 160 \
    --out "$OUT/generate_long.jsonl" > "$OUT/generate_long.log" 2>&1; echo "bench rc=$? after ${SECONDS}s"
grep decode_generate "$OUT/generate_long.jsonl" | cut -c1-600
timeout 120 python3 benchmarks/profile_prefill.py --batch 8 --prompt 2048 --tokens 1 --top 30 --static-decode auto \
    --variants bf16,fp4 > "$OUT/prefill_graph_b8.jsonl" 2> "$OUT/prefill_graph_b8.log"; echo "prof rc=$? after ${SECONDS}s"
python3 -c "
import json
for l in open('$OUT/prefill_graph_b8.jsonl'):
    r=json.loads(l); i=r['idle']
    print(r['variant'], r['batch'], 'wall', r['walls_ms'], 'gpu', r['gpu_ms'], 'span', i.get('span_ms'), 'idle', i.get('idle_ms'), 'late', i.get('host_late_ms'))
"
