#!/usr/bin/env bash
# Session 10, call 6: Nsight Compute on the new guided compact tile and the W4A16 GEMM at 1 and 16 tokens per
# expert: speed of light, occupancy, pipe use and warp stall reasons ($OUT/ncu.txt).
source benchmarks/_device_env.sh
ONLY="${1:-^guided_compact|^fp4_gemm_qwen3_fc1_t(1|16)$}"
ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --print-details all python3 benchmarks/ncu_kernels.py --only "$ONLY" > "$OUT/ncu.txt" 2> "$OUT/ncu.err" \
    || { tail "$OUT/ncu.err"; exit 1; }
grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Compute \(SM\)|Issue Slots Busy|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|No Eligible|Active Warps Per|Pipe|ALU|FMA" "$OUT/ncu.txt" | head -150
