#!/usr/bin/env bash
# Session 5's last H200 call (< 380 s): where the QAT step's device time goes at the Qwen3-30B-A3B layer shape
# (--profile), the host syncs per step (--sync-sites), and the RL step of fp4_qat then trace alone on the GPU:
#   python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
#     --kernels auto --warmup 2 --reps 4 --profile
#   python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --sync-sites
#   SEEDS=0 ARMS=<arm> QM_EVERY=0 EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12
# Needs the wheels in ./.whl (carry .whl). -> $OUT/*.json, $OUT/rl.tgz
set -uo pipefail
OUT="${OUT:-/tmp/out}"; R=/tmp/s5; mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
timeout 70 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
  --kernels auto --warmup 2 --reps 4 --profile > "$OUT/qat_qwen3_profile.json" 2> "$R/p.log"
echo "profile rc=$? after ${SECONDS}s"; grep "ms/step" "$R/p.log"
timeout 80 python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --sync-sites \
  > "$OUT/qat_syncs.json" 2> "$R/s.log"
echo "syncs rc=$? after ${SECONDS}s"; grep "ms/step" "$R/s.log"
bash benchmarks/rl_overhead.sh "$R" && cp "$R/rl.tgz" "$OUT/"
