#!/usr/bin/env bash
# Issue 9 in one device call on nvidia-h200-x2: EP=2 vs EP=1 (benchmarks/two_gpu_ep.py) and disaggregated
# rollout/trainer RL step (benchmarks/two_gpu_disagg.py). Run from the repo root with the wheels of megatron-core,
# mbridge, einops, hydra-core, omegaconf, antlr4 in ./.whl (carry .whl):
#   bash benchmarks/device_two_gpu.sh          -> $OUT/two_gpu_ep.jsonl, $OUT/two_gpu_disagg.jsonl, *.log
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    TORCHDYNAMO_DISABLE=1
source benchmarks/_install_wheels.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/smi.txt"
nvidia-smi topo -m >> "$OUT/smi.txt" 2>&1
timeout ${EP_TIMEOUT:-300} python3 benchmarks/two_gpu_ep.py --timeout 280 --out "$OUT/two_gpu_ep.jsonl" \
    > "$OUT/two_gpu_ep.log" 2>&1
echo "two_gpu_ep rc=$?"; tail -n 3 "$OUT/two_gpu_ep.log" | cut -c1-1500
timeout ${DISAGG_TIMEOUT:-240} python3 benchmarks/two_gpu_disagg.py --timeout 220 --out "$OUT/two_gpu_disagg.jsonl" \
    > "$OUT/two_gpu_disagg.log" 2>&1
echo "two_gpu_disagg rc=$?"; tail -n 3 "$OUT/two_gpu_disagg.log" | cut -c1-2500
true
