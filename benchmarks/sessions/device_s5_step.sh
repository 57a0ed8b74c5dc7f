#!/usr/bin/env bash
# Session 5, one H200 (< 580 s): the quantize kernels after the in-kernel exact redo (GPU tests + bandwidth; TESTS=0
# skips them), and the training step timed in interleaved rounds, Python GC automatic vs manual, at two shapes:
#   pytest tests/kernels/test_quant_triton.py tests/gpu/test_megatron_gpu.py
#   python3 benchmarks/bench_quant.py
#   python3 benchmarks/bench_qat_step.py --kernels auto --warmup 3 --reps 10 [--gc manual]
#   python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
#     --kernels auto --warmup 2 --reps 8 --gc manual
# Needs the wheels in ./.whl (carry .whl). -> $OUT/*.json, logs
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --tb=short tests/kernels/test_quant_triton.py \
    tests/gpu/test_megatron_gpu.py > "$OUT/pytest.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s"; grep -E "passed|failed|FAILED" "$OUT/pytest.log" | tail -n 12
  timeout 70 python3 benchmarks/bench_quant.py > "$OUT/quant.json" 2> "$OUT/quant.log"
  echo "quant rc=$? after ${SECONDS}s"
fi
for gc in auto manual; do
  timeout 90 python3 benchmarks/bench_qat_step.py --kernels auto --warmup 3 --reps 10 --gc $gc \
    > "$OUT/qat_step_$gc.json" 2> "$OUT/qat_step_$gc.log"
  echo "qat gc=$gc rc=$? after ${SECONDS}s"; grep "ms/step" "$OUT/qat_step_$gc.log"
done
timeout 160 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
  --kernels auto --warmup 2 --reps 8 --gc manual > "$OUT/qat_step_qwen3.json" 2> "$OUT/qat_step_qwen3.log"
echo "qwen3 rc=$? after ${SECONDS}s"; grep "ms/step" "$OUT/qat_step_qwen3.log"; tail -n 3 "$OUT/qat_step_qwen3.log"
