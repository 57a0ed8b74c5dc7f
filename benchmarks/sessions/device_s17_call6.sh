#!/usr/bin/env bash
# Session 17, call 6 (the last of the device time): Nsight Compute on the three quantize kernels this session
# changed (guided compact + dequant in its prefetching grid, quantize + record, RNE fake-quant at 2 warps) and copy:
# are the first two now limited by instruction issue, as their SASS counts suggest, or still by memory latency?
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
ONLY='^quantize_nvfp4_row|^guided_compact|^fake_quant|^copy'
timeout 100 ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --print-details all python3 benchmarks/ncu_kernels.py --ops quant \
    --only "$ONLY" > "$OUT/ncu.txt" 2> "$OUT/ncu.err" || tail -5 "$OUT/ncu.err"
grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|No Eligible|Active Warps Per|Stall (Long Scoreboard|Not Selected|Math Pipe|Barrier|Wait|Short Scoreboard|Selected|MIO)" "$OUT/ncu.txt" | head -90
gzip -f "$OUT/ncu.txt"
