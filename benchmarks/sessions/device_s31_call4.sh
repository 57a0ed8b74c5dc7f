#!/usr/bin/env bash
# Session 31, call 4: what this session's host-time changes do to whole graph generates (static_decode="graph", the
# CUDA default: prefill, one eager decode step, the capture, replays), A/B on one machine against HEAD 2f30281
# (build/ab_base): bench_generate_graph.py at batch 8 and 32, 2048-token prompts, 1 / 4 / 16 new tokens, base / new
# / base / new; one JSON file (each line tagged with its arm and round).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
NEW="$PYTHONPATH"
BASE="/tmp/site:$PWD/build/ab_base:$PWD/benchmarks"
for rep in 1 2; do
  for arm in base new; do
    if [ "$arm" = base ]; then export PYTHONPATH="$BASE"; else export PYTHONPATH="$NEW"; fi
    for b in 8 32; do
      timeout 120 python3 benchmarks/bench_generate_graph.py --batch $b --prompt 2048 --tokens 1,4,16 \
          --variants graph --reps 5 2>> "$OUT/gen_ab.err" | sed "s/^{/{\"arm\": \"$arm\", \"round\": $rep, /" \
          >> "$OUT/gen_ab.jsonl"
      echo "$arm b$b r$rep rc=${PIPESTATUS[0]}"
    done
  done
done
python3 - "$OUT/gen_ab.jsonl" <<'PY'
import json, sys
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[(r["batch"], r["new_tokens"], r["mode"], r["arm"])].append(r["graph_s"])
for key in sorted(rows):
    print(key, rows[key])
PY
