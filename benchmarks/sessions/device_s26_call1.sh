#!/usr/bin/env bash
# Session 26, call 1: Nsight Compute on the CUDA FP4 GEMM (moe_mma) at Qwen3's FC1, 1 and 16 tokens per expert,
# NVFP4 and MXFP4, the default build and SKIP_DEQUANT=1: where its warps stall, how busy DRAM and the pipes are.
source benchmarks/_device_env.sh > /dev/null 2>&1
ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
    python3 benchmarks/ncu_kernels.py --ops mma > "$OUT/ncu_mma.txt" 2> "$OUT/ncu_mma.err"
echo "ncu rc=$?"; tail -3 "$OUT/ncu_mma.err"
grep -E "^  [a-z_0-9+=]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Issue Slots Busy|No Eligible|Registers Per" "$OUT/ncu_mma.txt" | head -80
gzip -kf "$OUT/ncu_mma.txt"
