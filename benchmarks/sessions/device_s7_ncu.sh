#!/usr/bin/env bash
# Session 7: Nsight Compute on the Triton FP4 kernels (benchmarks/ncu_kernels.py), one launch each.
# Writes $OUT/ncu_<ops>.txt (details page: speed of light, occupancy, launch, warp states, scheduler, memory).
source benchmarks/_device_env.sh
OPS="${1:-all}"
ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/ncu_kernels.py --ops "$OPS" > "$OUT/ncu_$OPS.txt" 2> "$OUT/ncu_$OPS.err"
rc=$?
tail -5 "$OUT/ncu_$OPS.err"
grep -E "^  [a-z_0-9+]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Theoretical Occupancy|Block Limit" "$OUT/ncu_$OPS.txt" | head -150
exit $rc
