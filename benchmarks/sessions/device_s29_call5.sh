#!/usr/bin/env bash
# Session 29, call 5: (1) the GPU tests of the experts paths (new: prefill-sized calls on the dequantized weights) and
# of the rollout; (2) when the decode step's CUDA graph pays for its capture: generate with static_decode graph /
# eager / off against the number of new tokens (new bench_generate_graph.py), batch 8 and 32, 2048-token prompts.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py \
    -k "experts or rollout or generate or static" > "$OUT/tests.log" 2>&1; echo "tests rc=$? after ${SECONDS}s"
tail -3 "$OUT/tests.log"
for b in 8 32; do
  timeout 150 python3 benchmarks/bench_generate_graph.py --batch $b --prompt 2048 --tokens 1,4,16,64 --reps 3 \
      > "$OUT/graph_b$b.jsonl" 2> "$OUT/graph_b$b.log"; echo "b$b rc=$? after ${SECONDS}s"
  cut -c1-170 "$OUT/graph_b$b.jsonl"
done
