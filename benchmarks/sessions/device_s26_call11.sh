#!/usr/bin/env bash
# Session 26, call 11: the balanced split without the per-expert cost prefix in shared memory (next_segment: a
# thread per expert, recomputed per segment), so it fits beside DeepSeek-V3's 8 token rows of K = 7168 too. GPU tests
# of the CUDA GEMM, then the same tokens on every expert (against call 8), random routing at Qwen3's FC1 (against
# call 5) and at DeepSeek-V3's FC1 (against call 10), and DeepSeek-V3's FC1 with the same tokens (against call 9).
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/gpu/test_moe_mma_gpu.py tests/kernels/test_moe_mma.py \
    tests/gpu/test_kv_attention_gpu.py -k "mma or grouped or packed" > "$OUT/pytest_moe_mma.txt" 2>&1
echo "pytest rc=$?"; tail -2 "$OUT/pytest_moe_mma.txt"
for fmt in nvfp4 mxfp4; do
  timeout 100 python3 benchmarks/bench_moe_mma.py --fmt $fmt --tokens 1,4,16 --variants "" --packed \
      > "$OUT/moe_mma_uniform_$fmt.json" 2> "$OUT/moe_mma_uniform_${fmt}_err.txt"; echo "uniform $fmt rc=$?"
  python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_uniform_$fmt.json"
done
timeout 100 python3 benchmarks/bench_moe_mma_routing.py --shapes qwen3_fc1,qwen3_fc2 --batches 1,4,16,64,256 \
    > "$OUT/moe_mma_routing_qwen3.jsonl" 2> "$OUT/moe_mma_routing_qwen3_err.txt"; echo "routing qwen3 rc=$?"
python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_routing_qwen3.jsonl"
timeout 150 python3 benchmarks/bench_moe_mma_routing.py --shapes dsv3_fc1 --batches 1,4,16,32,64,128,256 \
    > "$OUT/moe_mma_routing_dsv3.jsonl" 2> "$OUT/moe_mma_routing_dsv3_err.txt"; echo "routing dsv3 rc=$?"
python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_routing_dsv3.jsonl"
timeout 100 python3 benchmarks/bench_moe_mma.py --shapes dsv3_fc1 --tokens 1,4 --variants "" --packed \
    > "$OUT/moe_mma_dsv3.json" 2> "$OUT/moe_mma_dsv3_err.txt"; echo "bench dsv3 rc=$?"
python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_dsv3.json"
