#!/usr/bin/env bash
# EP = 1, 2, 4, 8 (as many as this host has GPUs), each with torchrun over world = EP, then the plot and tables.
#   bash examples/ep_scaling/sweep.sh [ep_scaling.py args]     e.g. --experts 128
set -euo pipefail
OUT="${OUT:-outputs/ep_scaling}"; export OUT
GPUS=$(nvidia-smi -L | wc -l)
for EP in 1 2 4 8; do
    if (( EP > GPUS )); then echo "EP=$EP skipped: $GPUS GPUs"; continue; fi
    bash "$(dirname "$0")/launch.sh" "$EP" "$@" || echo "EP=$EP failed: see $OUT/ep$EP.log"
done
python3 benchmarks/plot_ep_scaling.py "$OUT/ep_scaling.jsonl" --png "$OUT/ep_scaling.png" --md "$OUT/ep_scaling.md" \
    --json "$OUT/projection.json"
echo "plot: $OUT/ep_scaling.png, tables: $OUT/ep_scaling.md"
