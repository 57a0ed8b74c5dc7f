#!/usr/bin/env bash
# Session 7: where the Triton FP4 kernels stall (Nsight Compute): per op, the warp-state breakdown
# ($OUT/stalls.txt) and, for the ops matching $1, the SASS with sampled stalls per instruction ($OUT/src_*.csv).
source benchmarks/_device_env.sh
ONLY="${1:-guided_compact|quantize_nvfp4_row|fp4_gemm_qwen3_fc1_t16}"
NCU=(ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel)
"${NCU[@]}" --section WarpStateStats --section InstructionStats --section SchedulerStats --print-details all \
    python3 benchmarks/ncu_kernels.py --only "$ONLY" > "$OUT/stalls.txt" 2> "$OUT/stalls.err" || { tail "$OUT/stalls.err"; exit 1; }
for op in guided_compact quantize_nvfp4_row fp4_gemm_qwen3_fc1_t16; do
  [[ "$op" =~ $ONLY ]] || continue
  "${NCU[@]}" --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      python3 benchmarks/ncu_kernels.py --only "$op" > "$OUT/src_$op.csv" 2>> "$OUT/stalls.err" || tail "$OUT/stalls.err"
done
grep -iE "^  [a-z]|stall|Warp Cycles Per Issued" "$OUT/stalls.txt" | head -120
ls -la "$OUT"
