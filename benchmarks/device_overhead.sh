#!/usr/bin/env bash
# Session-4 overhead evidence on one H200 (< 560 s): where the guided QAT step's extra time goes, and the RL step
# overhead of `trace` vs `fp4_qat` after `records.pack_guidance`, each arm alone on the GPU (sequential).
#   1. python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --profile
#   2. SEEDS=0 ARMS=<arm> QM_EVERY=0 EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12,
#      for arm in fp4_qat, trace (one after the other, nothing else on the GPU)
# Needs the wheels of megatron-core, mbridge, einops, hydra-core, omegaconf, antlr4 in ./.whl (carry .whl).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; R=/tmp/overhead; mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$R/smi.txt"
timeout "${QAT_S:-200}" python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --profile \
  > "$R/qat_step.json" 2> "$R/qat_step.log"
echo "phase 1 rc=$? after ${SECONDS}s"; tail -n 6 "$R/qat_step.log"
for arm in fp4_qat trace; do
  OUT="$R/rl_$arm" SEEDS=0 ARMS="$arm" QM_EVERY=0 INSTALL_WHL=0 BUDGET_S=${RL_S:-150} \
    EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12 > "$R/rl_$arm.log" 2>&1
  echo "rl $arm done after ${SECONDS}s"; tail -n 3 "$R/rl_$arm.log"
done
tar -czf "$OUT/results.tgz" -C /tmp overhead
ls -la "$OUT"
