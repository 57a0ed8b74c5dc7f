#!/usr/bin/env bash
# The GPU comparison of the five arms (issue: RL main job, GPU config). Run on the device box from the repo root
# with the wheels of megatron-core, mbridge, einops, hydra-core, omegaconf, antlr4 in ./.whl:
#   bash benchmarks/gpu_rl_run.sh [STEPS] [SEED]      (env: ARMS=[trace,trace_full] SMOKE=0 RL_TIMEOUT=420)
set -uo pipefail
STEPS=${1:-40}; SEED=${2:-0}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
source benchmarks/_install_wheels.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ "${SMOKE:-1}" = 0 ] || timeout 60 python3 examples/rl_demo.py --config-name gpu run_name=gpu_smoke rl.steps=2 sft.steps=10 \
    rl.eval_problems=32 progress=false arms=[fp4_qat,trace] || { echo "SMOKE FAILED"; exit 1; }
timeout ${RL_TIMEOUT:-420} python3 examples/rl_demo.py --config-name gpu run_name=gpu_seed$SEED rl.steps=$STEPS \
    rl.seed=$SEED progress=false ${ARMS:+arms=$ARMS}
echo "rc=$?"
mkdir -p "${OUT:-/tmp/out}"
cp outputs/gpu_seed$SEED/metrics.jsonl "${OUT:-/tmp/out}/metrics_seed$SEED.jsonl" 2>/dev/null
cp outputs/gpu_seed$SEED/summary.md "${OUT:-/tmp/out}/summary_seed$SEED.md" 2>/dev/null
true
