#!/usr/bin/env bash
# Session 24, call 6: the GPU tests that the CUDA GEMM's auto choice reaches (tests/gpu: the rollout's FP4 path
# now runs it at decode sizes; the Triton GEMM's tests), the end-to-end decode with the CUDA GEMM against the
# Triton one, and the GEMM table at 1-256 tokens per expert (bench_moe_gemm, which now times both kernels).
# (As run: then `--gemm auto` ran the CUDA kernel where moe_mma.preferred held; since call 7 that is `--gemm mma`,
# and `auto` is the Triton kernel.)
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 230 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu tests/kernels/test_moe_triton.py \
    tests/kernels/test_moe_mma.py > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? after ${SECONDS}s"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -2 "$OUT/pytest.txt"
export TORCHDYNAMO_DISABLE=0
for gemm in auto triton; do  # (now: mma triton)
  timeout 100 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 16,64,256 \
      --prompts 1024 --steps 24 --compile layers --graph-only --gemm $gemm > "$OUT/decode_$gemm.jsonl" \
      2> "$OUT/decode_$gemm.err"; echo "decode $gemm rc=$?"; cut -c1-200 "$OUT/decode_$gemm.jsonl"
done
export TORCHDYNAMO_DISABLE=1
timeout 150 python3 benchmarks/bench_moe_gemm.py --shapes qwen3_fc1,qwen3_fc2 --tokens 1,2,4,8,16,32,64,256 \
    --no-sweep > "$OUT/moe_gemm.json" 2> "$OUT/moe_gemm_err.txt"; echo "moe_gemm rc=$?"
grep -E "mma" "$OUT/moe_gemm_err.txt" | head -40
gzip -f "$OUT/pytest.txt"
