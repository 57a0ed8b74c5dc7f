#!/usr/bin/env bash
# Session 6's first H200 call (< 590 s): GPU tests (Megatron + rollout), the training step at the Qwen3-30B-A3B
# layer shape with 1 and 4 micro-batches (measures the router-hook gather and the up-front guidance copy), and the
# guidance capture share of generate():
#   pytest tests/gpu/test_megatron_gpu.py tests/gpu/test_rollout_gpu.py
#   python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
#     --kernels auto --warmup 2 --reps 8 --gc manual [--micro-batches 4 --reps 5]
#   python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 1024 --no-graph \
#     --generate-batches 8,64 --gen-tokens 128 --gen-reps 1
# Needs the wheels in ./.whl (carry .whl). -> $OUT/*.json, logs
set -uo pipefail
source benchmarks/_device_env.sh
V=bf16_grouped,fp4_qat,trace_guided
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE --tb=short tests/gpu/test_megatron_gpu.py \
  tests/gpu/test_rollout_gpu.py > "$OUT/pytest.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; grep -E "passed|failed|FAILED" "$OUT/pytest.log" | tail -n 12
timeout 110 python3 benchmarks/bench_decode.py --modes bf16,fp4 --batches 8 --lengths 1024 --no-graph \
  --generate-batches 8,64 --gen-tokens 128 --gen-reps 1 \
  > "$OUT/decode_capture.jsonl" 2> "$OUT/decode.log"
echo "capture rc=$? after ${SECONDS}s"; grep decode_generate "$OUT/decode_capture.jsonl"
timeout 140 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants $V --kernels auto --warmup 2 \
  --reps 8 --gc manual > "$OUT/qat_step_qwen3.json" 2> "$OUT/qat_qwen3.log"
echo "qwen3 mb1 rc=$? after ${SECONDS}s"; grep "ms/step" "$OUT/qat_qwen3.log"; tail -n 3 "$OUT/qat_qwen3.log"
timeout 170 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants $V --kernels auto --warmup 2 \
  --reps 5 --gc manual --micro-batches 4 > "$OUT/qat_step_qwen3_mb4.json" 2> "$OUT/qat_qwen3_mb4.log"
echo "qwen3 mb4 rc=$? after ${SECONDS}s"; grep "ms/step" "$OUT/qat_qwen3_mb4.log"; tail -n 3 "$OUT/qat_qwen3_mb4.log"
