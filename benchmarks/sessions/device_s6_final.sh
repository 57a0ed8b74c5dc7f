#!/usr/bin/env bash
# Session 6's last H200 call (< 420 s): GPU tests (quantize kernels, Megatron, rollout incl. the records written by
# the quantize pass and a decode step without host syncs while recording), then the guidance capture share of
# generate() in interleaved rounds:
#   pytest tests/kernels/test_quant_triton.py tests/gpu/test_megatron_gpu.py tests/gpu/test_rollout_gpu.py
#   python3 benchmarks/bench_decode.py --modes fp4 --batches 8 --lengths 1024 --no-graph --steps 2 \
#     --generate-batches 8,64 --gen-tokens 64 --gen-reps 7 [--gen-gc manual]
# Needs the wheels in ./.whl (carry .whl). -> $OUT/*
set -uo pipefail
source benchmarks/_device_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --tb=short tests/kernels/test_quant_triton.py \
  tests/gpu/test_megatron_gpu.py tests/gpu/test_rollout_gpu.py > "$OUT/pytest.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -n 12
for g in auto manual; do
  timeout 150 python3 benchmarks/bench_decode.py --modes fp4 --batches 8 --lengths 1024 --no-graph --steps 2 \
    --generate-batches 8,64 --gen-tokens 64 --gen-reps 7 --gen-gc $g > "$OUT/capture_$g.jsonl" 2> "$OUT/capture_$g.log"
  echo "capture gc=$g rc=$? after ${SECONDS}s"; grep decode_generate "$OUT/capture_$g.jsonl" | cut -c1-420
done
