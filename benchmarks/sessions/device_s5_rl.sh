#!/usr/bin/env bash
# Session 5, one H200 (< 480 s): the RL mismatch of the hf rollout's fast FP4-KV decode attention against the
# exact one over 3 seeds (one SFT, the same prompts per seed; 9 processes on one GPU, so step times are contended):
#   SEEDS="0 1 2" ARMS="bf16 trace tracefast=trace:rl.fast_kv_attention=true" QM_EVERY=0 \
#     EXTRA="sft.steps=300 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 20
# Needs the wheels in ./.whl (carry .whl). -> $OUT/rl.tgz, $OUT/rl.log
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
OUT="$OUT/rl" SEEDS="0 1 2" ARMS="bf16 trace tracefast=trace:rl.fast_kv_attention=true" QM_EVERY=0 \
  BUDGET_S=400 EXTRA="sft.steps=300 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 20 > "$OUT/rl.log" 2>&1
echo "rl done after ${SECONDS}s"; tail -n 12 "$OUT/rl.log"
tar -czf "$OUT/rl.tgz" -C "$OUT" rl && rm -rf "$OUT/rl"
