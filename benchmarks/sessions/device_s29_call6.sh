#!/usr/bin/env bash
# Session 29, call 6: the GPU tests of generate's static decode (new: "auto" runs generates of fewer than
# hf_generate.GRAPH_FROM_NEW_TOKENS new tokens eagerly), then bench_generate_graph with the "auto" variant at
# 1, 2, 4 new tokens (batch 8, 2048-token prompts). The threshold and the "auto" variant were replaced after this call
# (commit acff0a2: the graph is captured after the first decode step); this script records what ran at ca30c20.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_rollout_gpu.py \
    -k "auto_graph or default_decode_on_cuda or graph_decode_equals or static_decode_replays" > "$OUT/tests.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; tail -3 "$OUT/tests.log"
timeout 150 python3 benchmarks/bench_generate_graph.py --batch 8 --prompt 2048 --tokens 1,2,4 --reps 3 \
    --variants auto,graph,eager > "$OUT/graph_b8.jsonl" 2> "$OUT/graph_b8.log"; echo "bench rc=$? after ${SECONDS}s"
cut -c1-200 "$OUT/graph_b8.jsonl"
