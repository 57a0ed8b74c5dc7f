#!/usr/bin/env bash
# Session 4's last H200 call (< 540 s): the fast FP4-KV decode attention (GPU tests + per-layer benchmark), the
# Megatron GPU tests (deferred NaN/Inf checks, host syncs of a QAT step), the QAT step benchmark.
#   pytest tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py::<fused decode, CUDA graph>
#          tests/gpu/test_megatron_gpu.py
#   python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 1024,8192,32768
#   python3 benchmarks/bench_qat_step.py --kernels auto --warmup 3 --reps 10
# Needs the wheels in ./.whl (carry .whl). -> $OUT/*.json, logs
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
R=tests/gpu/test_rollout_gpu.py
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --tb=short tests/gpu/test_kv_attention_gpu.py \
  "$R::test_fused_decode_attention_matches_dequantize_then_sdpa" "$R::test_decode_step_replays_in_a_cuda_graph" \
  tests/gpu/test_megatron_gpu.py > "$OUT/pytest.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; grep -E "passed|failed|FAILED" "$OUT/pytest.log" | tail -n 20
timeout 150 python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 1024,8192,32768 \
  > "$OUT/decode_attn.jsonl" 2> "$OUT/decode_attn.log"
echo "attn rc=$? after ${SECONDS}s"
timeout 110 python3 benchmarks/bench_qat_step.py --kernels auto --warmup 3 --reps 10 > "$OUT/qat_step.json" \
  2> "$OUT/qat_step.log"
echo "qat rc=$? after ${SECONDS}s"; grep "ms/step" "$OUT/qat_step.log"
