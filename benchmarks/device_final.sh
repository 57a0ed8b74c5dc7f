#!/usr/bin/env bash
# The session's GPU evidence in one device call on nvidia-h200-x2 (< 560 s), three phases:
#   1. GPU 0: the GPU tests of the kernels (bit-exact vs the CPU reference);  GPU 1: bench_decode (device_decode.sh)
#   2. GPU 0: bench_quant.py, bench_moe_gemm.py;  GPU 1: bench_qat_step.py
#   3. the RL step overhead without contention: fp4_qat on GPU 0, trace on GPU 1 (gpu_rl_seeds.sh)
# Needs the wheels of megatron-core, mbridge, einops, hydra-core, omegaconf, antlr4 in ./.whl (carry .whl).
# -> $OUT/results.tgz (logs, JSON, decode plot, RL metrics)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; R=/tmp/final; mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
source benchmarks/_install_wheels.sh || exit 1
export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$R/smi.txt"
( CUDA_VISIBLE_DEVICES=1 OUT="$R/decode" TOTAL_S=${DECODE_S:-215} INSTALL_WHL=0 bash benchmarks/device_decode.sh \
    > "$R/decode_run.log" 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 timeout "${TEST_TIMEOUT:-210}" python3 -m pytest tests/kernels tests/gpu/test_kv_attention_gpu.py \
  -q -p no:cacheprovider -n 16 -rfE --tb=line 2>&1 | tail -n 80 > "$R/pytest.log"
echo "phase 1 tests rc=$? after ${SECONDS}s"; tail -n 4 "$R/pytest.log"
wait; echo "phase 1 decode done after ${SECONDS}s"
( CUDA_VISIBLE_DEVICES=1 timeout 150 python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 \
    > "$R/qat_step.json" 2> "$R/qat_step.log" ) &
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/bench_quant.py > "$R/quant.json" 2> "$R/quant.log"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_moe_gemm.py > "$R/moe.json" 2> "$R/moe.log"
wait; echo "phase 2 done after ${SECONDS}s"
OUT="$R/rl" SEEDS=0 ARMS="fp4_qat trace" QM_EVERY=0 INSTALL_WHL=0 BUDGET_S=${RL_S:-160} \
  EXTRA="sft.steps=50 rl.eval_problems=64" bash benchmarks/gpu_rl_seeds.sh 12 > "$R/rl_run.log" 2>&1
echo "phase 3 done after ${SECONDS}s"; tail -n 4 "$R/rl_run.log"
tar -czf "$OUT/results.tgz" -C /tmp final
ls -la "$OUT"
