#!/usr/bin/env bash
# Proposed for the next session (session 31 had no device time left to run it). Session 31, call 3: the FP4 prefill
# host time read 39.1-39.8 ms at HEAD 2f30281 (build/ab_base: git archive 2f30281 megatron_trace) and 39.3-54.7 ms
# with session 31's code in 4 runs. The same prefill (batch 32, 512-token prompts, FP4), base / new x 3 rounds, with
# its own time per module class, one JSON file (carry .whl and build/ab_base).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
NEW="$PYTHONPATH"
BASE="/tmp/site:$PWD/build/ab_base:$PWD/benchmarks"
for rep in 1 2 3; do
  for arm in base new; do
    if [ "$arm" = base ]; then export PYTHONPATH="$BASE"; else export PYTHONPATH="$NEW"; fi
    timeout 60 python3 benchmarks/profile_step_host.py --modes fp4 --batch 32 --prompt 512 --tokens 2 --reps 2 \
        2>> "$OUT/prefill.err" | sed "s/^{/{\"arm\": \"$arm\", \"round\": $rep, /" >> "$OUT/prefill.jsonl"
  done
done
python3 - "$OUT/prefill.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    own = r["prefill_own_ms"]
    print(r["arm"], r["round"], "gen", r["generate_ms"], "prefill", r["prefill_host_ms"], "decode", r["decode_step_host_ms"],
          {k: own[k] for k in list(own)[:6]})
PY
