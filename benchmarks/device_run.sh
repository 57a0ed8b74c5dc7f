#!/bin/bash
# One device call: GPU tests of megatron_trace/kernels, then the kernel benchmarks; logs and JSON under $OUT.
# Usage (from the repo root, on the GPU machine): bash benchmarks/device_run.sh [pytest-args...]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/bench_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/smi.txt"
timeout 240 python3 -m pytest tests/kernels -q -p no:cacheprovider -n 8 "$@" 2>&1 | tail -40 | tee "$OUT/pytest.log"
timeout 90 python3 benchmarks/bench_quant.py > "$OUT/bench_quant.json" 2> >(tee "$OUT/bench_quant.txt" >&2)
timeout 230 python3 benchmarks/bench_moe_gemm.py ${MOE_ARGS:-} > "$OUT/bench_moe.json" 2> >(tee "$OUT/bench_moe.txt" >&2)
echo "exit codes done"
