#!/usr/bin/env bash
# Session 9, first call: what session 8 did not run at its final code. The whole GPU test suite (quantize kernels,
# GEMM, attention incl. the head_dim-64 launch configs, rollout, Megatron), the head_dim-64 attention sweep, and
# the training step (BF16 grouped vs FP4 QAT vs TRACE guided on Qwen3-30B-A3B's MoE shape).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 330 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels tests/gpu -k "not two_gpu" 2>&1 | tail -8
python3 benchmarks/bench_decode_attn.py --heads 16,4,64 --batches 8,64 --lengths 8192 \
    --alt 64,1,2,0 64,1,3,0 32,1,2,0 > "$OUT/attn64.jsonl" 2> "$OUT/attn64.err"; tail -2 "$OUT/attn64.err"
python3 benchmarks/summarize_rows.py attn "$OUT/attn64.jsonl"
timeout 200 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual > "$OUT/step.json" 2> "$OUT/step.err"; tail -3 "$OUT/step.err"
cat "$OUT/step.json"
