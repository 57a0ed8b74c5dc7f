#!/usr/bin/env bash
# Session 6, one H200 (< 560 s): rollout GPU tests (incl. recording without a host sync), the guidance capture share
# of generate(), then the RL step of fp4_qat and trace alone on the GPU (train-phase overhead):
#   pytest tests/gpu/test_rollout_gpu.py
#   python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 1024 --no-graph \
#     --generate-batches 8,64 --gen-tokens 128
#   SEEDS=0 ARMS=<arm> QM_EVERY=0 EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12
# Needs the wheels in ./.whl (carry .whl). RL=0 skips the RL phase. -> $OUT/*
set -uo pipefail
OUT="${OUT:-/tmp/out}"; R=/tmp/s6; mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE --tb=short tests/gpu/test_rollout_gpu.py \
  > "$OUT/pytest.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -n 12
timeout 110 python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 1024 --no-graph \
  --generate-batches 8,64 --gen-tokens 128 > "$OUT/decode_capture.jsonl" 2> "$OUT/decode.log"
echo "capture rc=$? after ${SECONDS}s"; grep decode_generate "$OUT/decode_capture.jsonl"
if [ "${RL:-1}" = 1 ]; then
  for arm in fp4_qat trace; do
    OUT="$R/rl_$arm" SEEDS=0 ARMS="$arm" QM_EVERY=0 INSTALL_WHL=0 BUDGET_S=105 \
      EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12 > "$R/rl_$arm.log" 2>&1
    echo "rl $arm done after ${SECONDS}s"; tail -n 2 "$R/rl_$arm.log"
  done
  tar -czf "$OUT/rl.tgz" -C "$R" rl_fp4_qat rl_trace
fi
