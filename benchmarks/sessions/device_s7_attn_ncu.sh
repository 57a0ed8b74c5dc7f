#!/usr/bin/env bash
# Session 7: Nsight Compute on the fast FP4-KV decode attention (and bf16 SDPA) at batch 8 / 64, 8K context.
source benchmarks/_device_env.sh
NCU=(ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel)
"${NCU[@]}" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --print-details all \
    python3 benchmarks/ncu_kernels.py --ops attn > "$OUT/attn.txt" 2> "$OUT/attn.err" || { tail "$OUT/attn.err"; exit 1; }
"${NCU[@]}" --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 benchmarks/ncu_kernels.py --ops attn --only "fp4_attn_b(8|64)_" > "$OUT/src_attn.csv" 2>> "$OUT/attn.err"
grep -E "^  [a-z]|Duration|DRAM Throughput|Registers Per|Achieved Occ|Theoretical Occ|Grid Size|Block Size|Issue Slots|Stall (Long|Barrier|Wait|Not Sel|Short|MIO|Math)|Warp Cycles Per Issued" "$OUT/attn.txt" | cut -c1-150
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kv_attention.py tests/gpu/test_kv_attention_gpu.py 2>&1 | tail -3
