#!/usr/bin/env bash
# The RL step of fp4_qat, then trace, each alone on the GPU (12 steps, no quantization metrics: clean step
# times), after a 50-step SFT warm-up; wheels already installed (INSTALL_WHL=0):
#   bash benchmarks/rl_overhead.sh WORKDIR     -> WORKDIR/rl_<arm>/metrics_s0_<arm>.jsonl, logs, WORKDIR/rl.tgz
set -uo pipefail
R=${1:?work dir}; mkdir -p "$R"
for arm in fp4_qat trace; do
  OUT="$R/rl_$arm" SEEDS=0 ARMS="$arm" QM_EVERY=0 INSTALL_WHL=0 BUDGET_S=105 \
    EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12 > "$R/rl_$arm.log" 2>&1
  echo "rl $arm done after ${SECONDS}s"; tail -n 2 "$R/rl_$arm.log"
done
tar -czf "$R/rl.tgz" -C "$R" rl_fp4_qat rl_trace
