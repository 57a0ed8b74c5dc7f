#!/usr/bin/env bash
# Session 26, call 4: the balanced split (moe_mma.BALANCED: the row blocks x passes of all experts dealt to one wave
# of CTAs). GPU tests of the CUDA GEMM; the same-tokens-per-expert bench (against calls 2-3: does the split's code
# cost anything?); the GEMM under random top-8 routing against Triton and bf16, NVFP4 and MXFP4.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_mma_gpu.py tests/kernels/test_moe_mma.py \
    > "$OUT/pytest_moe_mma.txt" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/pytest_moe_mma.txt"
timeout 150 python3 benchmarks/bench_moe_mma.py --fmt nvfp4 --tokens 1,4,16 --variants "" --packed \
    > "$OUT/moe_mma_uniform.json" 2> "$OUT/moe_mma_uniform_err.txt"; echo "bench uniform rc=$?"
python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_uniform.json"
for fmt in nvfp4 mxfp4; do
  timeout 200 python3 benchmarks/bench_moe_mma_routing.py --fmt $fmt > "$OUT/moe_mma_routing_$fmt.jsonl" \
      2> "$OUT/moe_mma_routing_${fmt}_err.txt"; echo "routing $fmt rc=$?"
  python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_routing_$fmt.jsonl"
done
