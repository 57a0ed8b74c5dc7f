#!/usr/bin/env bash
# Session 4, one H200 (< 560 s): the GPU tests of the changed code, then the training-step and RL-step overheads.
#   1. pytest tests/kernels/test_quant_triton.py tests/gpu/test_megatron_gpu.py (bit-exact kernels, deferred
#      NaN/Inf checks, host syncs of a QAT step)
#   2. python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --sync-sites
#   3. SEEDS=0 ARMS=<arm> QM_EVERY=0 EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12
#      for arm in fp4_qat, trace (one after the other, nothing else on the GPU)
# Needs the wheels in ./.whl (carry .whl). -> $OUT/results.tgz
set -uo pipefail
OUT="${OUT:-/tmp/out}"; R=/tmp/s4; mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
timeout "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --tb=short ${TESTS:-tests/kernels/test_quant_triton.py tests/gpu/test_megatron_gpu.py} > "$R/pytest.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; tail -n 25 "$R/pytest.log"
timeout "${QAT_S:-150}" python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --sync-sites ${QAT_EXTRA:-} \
  > "$R/qat_step.json" 2> "$R/qat_step.log"
echo "qat rc=$? after ${SECONDS}s"; grep "ms/step" "$R/qat_step.log"
for arm in ${RL_ARMS-fp4_qat trace}; do
  OUT="$R/rl_$arm" SEEDS=0 ARMS="$arm" QM_EVERY=0 INSTALL_WHL=0 BUDGET_S=${RL_S:-120} \
    EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12 > "$R/rl_$arm.log" 2>&1
  echo "rl $arm done after ${SECONDS}s"; tail -n 2 "$R/rl_$arm.log"
done
tar -czf "$OUT/results.tgz" -C /tmp s4
