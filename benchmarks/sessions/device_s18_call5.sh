#!/usr/bin/env bash
# Session 18, call 5: Nsight Compute on quantize + record (2 warps, code words) and guided compact + dequant (the
# plain grid) at this session's defaults, as session 17's call 6.
source benchmarks/_device_env.sh > /dev/null 2>&1
exec > >(tee -a "$OUT/log.txt") 2>&1
ONLY='^quantize_nvfp4_row|^guided_compact|^fake_quant|^copy'
timeout 100 ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --print-details all python3 benchmarks/ncu_kernels.py --ops quant \
    --only "$ONLY" > "$OUT/ncu.txt" 2> "$OUT/ncu.err" || tail -5 "$OUT/ncu.err"
grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|No Eligible|Active Warps Per|Stall (Long Scoreboard|Not Selected|Math Pipe|Barrier|Wait|Short Scoreboard|Selected|MIO)" "$OUT/ncu.txt" | head -90
gzip -f "$OUT/ncu.txt"
