#!/usr/bin/env bash
# Session 26, call 6: the rollout's FP4 experts with the packed CUDA GEMM (moe_mma.AUTO on: the store packs the
# weights, fp4_grouped_mm takes the CUDA kernel where moe_mma.preferred holds) against the Triton GEMM, end to end
# (graph-replayed decode steps of the Qwen3-30B-A3B-shaped model); first the GPU tests that reach the new paths.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs --tb=short tests/gpu/test_moe_mma_gpu.py \
    tests/gpu/test_kv_attention_gpu.py tests/kernels/test_moe_mma.py tests/rollout/test_packed_weight_store.py \
    > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? after ${SECONDS}s"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -2 "$OUT/pytest.txt"
export TORCHDYNAMO_DISABLE=0
for gemm in mma triton; do
  timeout 150 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 \
      --batches 4,16,64,256 --prompts 1024 --steps 24 --compile layers --graph-only --gemm $gemm \
      > "$OUT/decode_$gemm.jsonl" 2> "$OUT/decode_$gemm.err"; echo "decode $gemm rc=$? after ${SECONDS}s"
  cut -c1-220 "$OUT/decode_$gemm.jsonl"
done
gzip -f "$OUT/pytest.txt"
