#!/usr/bin/env bash
# Session 4, one H200 (< 300 s): host time of the QAT / guided step by Python function, and the RL mismatch with
# the hf rollout's fast FP4-KV decode attention against the exact one (same seed, SFT and prompts):
#   python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --host-profile
#   SEEDS=0 ARMS="bf16 trace tracefast=trace:rl.fast_kv_attention=true" QM_EVERY=0 \
#     EXTRA="sft.steps=300 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12
# Needs the wheels in ./.whl (carry .whl). -> $OUT/*
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
timeout 100 python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --host-profile \
  > "$OUT/qat_host.json" 2> "$OUT/qat_host.log"
echo "qat rc=$? after ${SECONDS}s"; grep "ms/step" "$OUT/qat_host.log"
OUT="$OUT/rl" SEEDS=0 ARMS="bf16 trace tracefast=trace:rl.fast_kv_attention=true" QM_EVERY=0 INSTALL_WHL=0 \
  BUDGET_S=150 EXTRA="sft.steps=300 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12 > "$OUT/rl.log" 2>&1
echo "rl done after ${SECONDS}s"; tail -n 4 "$OUT/rl.log"
tar -czf "$OUT/rl.tgz" -C "$OUT" rl && rm -rf "$OUT/rl"
