#!/usr/bin/env bash
# Issue 8 kernel tuning in one device call (nvidia-h200-x2; one GPU works too, serially): the GPU tests of the
# kernels on GPU 0, then the launch-config sweep of the quantize kernels on GPU 0, while the W4A16 grouped-GEMM
# sweep runs on GPU 1. Run from the repo root:
#   bash benchmarks/device_sweep.sh  -> $OUT/{smi.txt,pytest.log,sweep_quant.jsonl,sweep_moe.jsonl,sweep_err.txt}
# Each sweep prints one JSON line per (op or shape, config) and a last line with the best config per op/shape.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/smi.txt"
NGPU=$(nvidia-smi -L | wc -l); G1=$(( NGPU > 1 ? 1 : 0 ))
sweep() {  # gpu name script timeout
  CUDA_VISIBLE_DEVICES=$1 timeout "$4" python3 "$3" --sweep > "$OUT/sweep_$2.jsonl" 2> "$OUT/sweep_$2.err"
  echo "sweep $2 rc=$? after ${SECONDS}s"; tail -n 3 "$OUT/sweep_$2.err"
}
if [ "$G1" = 1 ]; then sweep 1 moe benchmarks/bench_moe_gemm.py "${MOE_TIMEOUT:-240}" & fi
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
CUDA_VISIBLE_DEVICES=0 timeout "${TEST_TIMEOUT:-180}" python3 -m pytest tests/kernels tests/gpu/test_kv_attention_gpu.py \
  -q -p no:cacheprovider -rfE --tb=line $XDIST 2>&1 | tail -n 60 > "$OUT/pytest.log"
echo "pytest rc=$? after ${SECONDS}s"; tail -n 3 "$OUT/pytest.log"
sweep 0 quant benchmarks/bench_quant.py "${QUANT_TIMEOUT:-150}"
if [ "$G1" = 0 ]; then sweep 0 moe benchmarks/bench_moe_gemm.py "${MOE_TIMEOUT:-240}"; fi
wait
cat "$OUT"/sweep_*.err > "$OUT/sweep_err.txt" 2>/dev/null; rm -f "$OUT"/sweep_*.err
echo "done after ${SECONDS}s"
