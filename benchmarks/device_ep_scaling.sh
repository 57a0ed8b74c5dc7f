#!/usr/bin/env bash
# Issue 10 on nvidia-h200-x2 in one device call (~240 s): EP scaling at EP=1 and EP=2 (benchmarks/ep_scaling.py),
# 64 experts, then 128 experts if time is left; then the plot, table and planner projections from the points.
# Run from the repo root with the wheels of megatron-core, einops (and the rest of device_two_gpu.sh's) in ./.whl
# (carry .whl):
#   bash benchmarks/device_ep_scaling.sh     -> $OUT/ep_scaling.jsonl, ep_scaling.png, ep_scaling.md, *.log
# BUDGET_S (default 230): the script's own wall budget; MAX_EP (default 2); EXPERTS (default "64 128").
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    TORCHDYNAMO_DISABLE=1
BUDGET_S="${BUDGET_S:-230}"; MAX_EP="${MAX_EP:-2}"; EXPERTS="${EXPERTS:-64 128}"
source benchmarks/_install_wheels.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/smi.txt"
nvidia-smi topo -m >> "$OUT/smi.txt" 2>&1
for e in $EXPERTS; do
    left=$(( BUDGET_S - SECONDS - 15 ))  # 15 s kept for the plot
    if (( left < 60 )); then echo "experts=$e skipped: ${left}s left"; break; fi
    timeout "$left" python3 benchmarks/ep_scaling.py --max-ep "$MAX_EP" --experts "$e" --timeout $(( left - 5 )) \
        --out "$OUT/ep_scaling.jsonl" > "$OUT/ep_scaling_e$e.log" 2>&1
    echo "ep_scaling experts=$e rc=$? at ${SECONDS}s"; tail -n 1 "$OUT/ep_scaling_e$e.log" | cut -c1-1500
done
timeout 30 python3 benchmarks/plot_ep_scaling.py "$OUT/ep_scaling.jsonl" --png "$OUT/ep_scaling.png" \
    --md "$OUT/ep_scaling.md" > "$OUT/plot.log" 2>&1
echo "plot rc=$?"; cat "$OUT/plot.log"; head -c 4000 "$OUT/ep_scaling.md"
true
