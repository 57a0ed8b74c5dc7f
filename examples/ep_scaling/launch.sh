#!/usr/bin/env bash
# One EP point set with torchrun: world = EP GPUs on this host, weak and strong scaling, FP4 QAT vs TRACE.
#   bash examples/ep_scaling/launch.sh 4 [--experts 128 ...]     (from the repo root; extra args go to the script)
# Appends JSON lines to ${OUT:-outputs/ep_scaling}/ep_scaling.jsonl.
set -euo pipefail
EP="${1:?usage: launch.sh EP [ep_scaling.py args]}"; shift
OUT="${OUT:-outputs/ep_scaling}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCHDYNAMO_DISABLE=1 \
    PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# one host: world = EP GPUs; several hosts: RDZV="--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT" and
# NPROC_PER_NODE = GPUs per host (world = EP = N x NPROC_PER_NODE)
# shellcheck disable=SC2086
torchrun ${RDZV:---standalone} --nproc-per-node "${NPROC_PER_NODE:-$EP}" benchmarks/ep_scaling.py \
    --out "$OUT/ep_scaling.jsonl" "$@" \
    2>&1 | tee "$OUT/ep$EP.log"
