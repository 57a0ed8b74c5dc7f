#!/usr/bin/env bash
# Session 16, call 1: the memory ceilings of the FP4 kernels' traffic shapes (bench_bandwidth.py), the quantize /
# dequantize kernels as they are (bench_quant.py, fake-quant's bytes corrected), Nsight Compute on dequantize,
# quantize + record and guided compact, and the GEMM tests at session 15's last launch rule (not run on the GPU).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 90 python3 benchmarks/bench_bandwidth.py > "$OUT/bandwidth.jsonl" 2> "$OUT/bandwidth.err"
tail -2 "$OUT/bandwidth.err"; cat "$OUT/bandwidth.jsonl"
timeout 150 python3 benchmarks/bench_quant.py > "$OUT/quant.json" 2> "$OUT/quant.err"; cat "$OUT/quant.err" | tail -20
ONLY='^dequantize|^quantize_nvfp4_row|^guided_compact|^copy'
timeout 150 ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --print-details all python3 benchmarks/ncu_kernels.py --ops quant \
    --only "$ONLY" > "$OUT/ncu.txt" 2> "$OUT/ncu.err" || tail -5 "$OUT/ncu.err"
grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|No Eligible|Active Warps Per" "$OUT/ncu.txt" | head -80
gzip -f "$OUT/ncu.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/kernels/test_moe_triton.py \
    tests/kernels/test_moe_slices.py -x 2>&1 | tail -5
