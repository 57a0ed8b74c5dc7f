#!/usr/bin/env bash
# Session 28, call 9: a whole HFRolloutBackend.generate (prefill + decode, capture on) with experts.PREFILL_WGMMA off
# and on, on the decode benchmark's ~2.1B Qwen3-MoE (32 experts, top-8; random weights): 2048-token prompts, 16 new
# tokens, batch 8 and 32 (prefill: 4096 and 16384 rows per expert), 3 interleaved rounds; BF16 beside it.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 300 python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 2048 --steps 2 --no-graph \
    --generate-batches 8,32 --gen-prompt 2048 --gen-tokens 16 --gen-reps 3 --gen-prefill-wgmma --budget-s 260 \
    --out "$OUT/generate.jsonl" > "$OUT/generate.log" 2>&1; echo "bench rc=$? after ${SECONDS}s"
grep decode_generate "$OUT/generate.jsonl" | cut -c1-700; tail -2 "$OUT/generate.log" | cut -c1-300
