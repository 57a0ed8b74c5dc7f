#!/usr/bin/env bash
# Session 5, one H200 (< 560 s): GPU tests of the quantize kernels (in-kernel exact redo) and of the Megatron
# plugin (guided-step plumbing), then the quantize benchmark, eager and CUDA-graph timed, for these kernels and
# (if ./old exists: `git archive 50e3781` with this bench_quant.py and _timing.py) for session 4's:
#   pytest -n 16 tests/kernels/test_quant_triton.py tests/gpu/test_megatron_gpu.py
#   python3 benchmarks/bench_quant.py          (and in ./old)
# Needs the wheels in ./.whl (carry .whl). -> $OUT/*
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks"
timeout 260 python3 -m pytest -q -p no:cacheprovider -n 16 -rfE --tb=short tests/kernels/test_quant_triton.py \
  tests/gpu/test_megatron_gpu.py > "$OUT/pytest.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest.log" | tail -n 12
timeout 100 python3 benchmarks/bench_quant.py > "$OUT/quant.json" 2> "$OUT/quant.log"
echo "quant rc=$? after ${SECONDS}s"; grep "of copy" "$OUT/quant.log"
if [ -d old ]; then
  ( cd old && PYTHONPATH="/tmp/site:$PWD:$PWD/benchmarks" timeout 100 python3 benchmarks/bench_quant.py \
    > "$OUT/quant_old.json" 2> "$OUT/quant_old.log" )
  echo "quant old rc=$? after ${SECONDS}s"; grep "of copy" "$OUT/quant_old.log"
fi
