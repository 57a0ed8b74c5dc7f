#!/usr/bin/env bash
# Session 6, one H200 (< 560 s): rollout GPU tests (incl. recording without a host sync), the guidance capture share
# of generate(), then the RL step of fp4_qat and trace alone on the GPU (train-phase overhead):
#   pytest tests/gpu/test_rollout_gpu.py
#   python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 1024 --no-graph \
#     --generate-batches 8,64 --gen-tokens 128 --gen-reps 1
#   bash benchmarks/rl_overhead.sh /tmp/s6   (fp4_qat then trace, 12 RL steps each)
# Needs the wheels in ./.whl (carry .whl). RL=0 skips the RL phase. -> $OUT/*
set -uo pipefail
source benchmarks/_device_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE --tb=short tests/gpu/test_rollout_gpu.py \
  > "$OUT/pytest.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -n 12
timeout 110 python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 1024 --no-graph \
  --generate-batches 8,64 --gen-tokens 128 --gen-reps 1 \
  > "$OUT/decode_capture.jsonl" 2> "$OUT/decode.log"
echo "capture rc=$? after ${SECONDS}s"; grep decode_generate "$OUT/decode_capture.jsonl"
if [ "${RL:-1}" = 1 ]; then
  bash benchmarks/rl_overhead.sh /tmp/s6 && cp /tmp/s6/rl.tgz "$OUT/"
fi
