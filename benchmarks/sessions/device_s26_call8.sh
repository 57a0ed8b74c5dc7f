#!/usr/bin/env bash
# Session 26, call 8: the final kernel's numbers with the same tokens on every expert (both formats, both layouts,
# and the packed layout without dequantization: the pipeline's ceiling), then Nsight Compute on it (1 and 16 tokens
# per expert, plain and packed, with and without dequantization).
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
for fmt in nvfp4 mxfp4; do
  timeout 120 python3 benchmarks/bench_moe_mma.py --fmt $fmt --tokens 1,4,8,16 --variants ,SKIP_DEQUANT=1 --packed \
      > "$OUT/moe_mma_final_$fmt.json" 2> "$OUT/moe_mma_final_${fmt}_err.txt"; echo "bench $fmt rc=$?"
  python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_final_$fmt.json"
done
timeout 150 ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section InstructionStats --section SourceCounters \
    python3 benchmarks/ncu_kernels.py --ops mma > "$OUT/ncu_mma.txt" 2> "$OUT/ncu_mma.err"; echo "ncu rc=$?"
grep -E "^  mma|Duration|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|Eligible Warps" "$OUT/ncu_mma.txt" \
    | sed 's/(const unsigned short.*//' | head -120
gzip -f "$OUT/ncu_mma.txt"
