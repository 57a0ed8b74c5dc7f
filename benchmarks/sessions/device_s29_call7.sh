#!/usr/bin/env bash
# Session 29, call 7: generate's graph decode now captures after its first (eager) step, with no warm-up runs. The
# GPU tests of generate's static decode, then bench_generate_graph (graph / eager) at 1, 2, 4, 16 new tokens, batch 8
# and 32, 2048-token prompts.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_rollout_gpu.py \
    -k "captures_after or default_decode_on_cuda or graph_decode_equals or static_decode_replays" > "$OUT/tests.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; tail -3 "$OUT/tests.log"
for b in 8 32; do
  timeout 120 python3 benchmarks/bench_generate_graph.py --batch $b --prompt 2048 --tokens 1,2,4,16 --reps 3 \
      --variants graph,eager > "$OUT/graph_b$b.jsonl" 2> "$OUT/graph_b$b.log"; echo "b$b rc=$? after ${SECONDS}s"
  cut -c1-150 "$OUT/graph_b$b.jsonl"
done
