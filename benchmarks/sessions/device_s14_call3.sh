#!/usr/bin/env bash
# Session 14, call 3: the W4A16 GEMM past 2**31 elements of x (int64 token offsets) and the dense attention at its
# new default, then the static decode loop with compiled layers (graph replays of compiled decoder layers) at the
# Qwen3-30B-A3B shape, 1K and 8K context; then generate with graphs and compiled layers.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rf --tb=short tests/kernels/test_moe_triton.py \
    tests/gpu/test_kv_attention_gpu.py -k "rows_past or int64 or dense" 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head
export TORCHDYNAMO_DISABLE=0
timeout 260 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 8,64 \
    --prompts 1024,8192 --steps 40 --compile layers > "$OUT/static_decode_compiled.jsonl" 2> "$OUT/static_decode_compiled.err"
tail -2 "$OUT/static_decode_compiled.err"; cut -c1-300 "$OUT/static_decode_compiled.jsonl"
timeout 170 python3 benchmarks/bench_decode.py --shape qwen3-30b-a3b --modes bf16,fp4f --batches 8 --lengths 1024 \
    --no-graph --generate-batches 8,64 --gen-prompt 512 --gen-tokens 512 --gen-reps 2 --static-decode graph \
    --compile layers --out "$OUT/generate_graph.jsonl" > /dev/null 2> "$OUT/generate_graph.err"
tail -2 "$OUT/generate_graph.err"; grep decode_generate "$OUT/generate_graph.jsonl" | cut -c1-330
