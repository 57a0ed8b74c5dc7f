# Session 34 call 1: whole graph generates (bench_generate_graph.py, session 31 call 4's command) at three codes:
# session 31's end (ff954f8, the last code timed end to end), session 32's end (1ef2a47: + the FP4 KV prefill read
# from the quantize pass, never timed) and HEAD (+ session 33's 68 correctness fixes). Rounds rotate the arms'
# order; batch 8 first in every round, then batch 32 while time is left. Carry .whl build/ab_s31 build/ab_s32, made by
#   for c in ff954f8:ab_s31 1ef2a47:ab_s32; do d=build/${c#*:}; rm -rf $d; mkdir -p $d
#     git archive ${c%:*} megatron_trace | tar -x -C $d; done
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
NEW="$PYTHONPATH"
declare -A PATHS=([s31]="/tmp/site:$PWD/build/ab_s31:$PWD/benchmarks" [s32]="/tmp/site:$PWD/build/ab_s32:$PWD/benchmarks"
                  [head]="$NEW")
for b in 8 32; do
  rep=0
  for order in "s31 s32 head" "s32 head s31" "head s31 s32"; do
    rep=$((rep + 1))
    for arm in $order; do
      if [ "$SECONDS" -gt "${STOP_S:-470}" ]; then echo "skip $arm b$b r$rep (${SECONDS}s)"; continue; fi
      export PYTHONPATH="${PATHS[$arm]}"
      timeout 100 python3 benchmarks/bench_generate_graph.py --batch $b --prompt 2048 --tokens 1,4,16 \
          --variants graph --reps 5 2>> "$OUT/gen_ab.err" | sed "s/^{/{\"arm\": \"$arm\", \"round\": $rep, /" \
          >> "$OUT/gen_ab.jsonl"
      echo "$arm b$b r$rep rc=${PIPESTATUS[0]} at ${SECONDS}s"
    done
  done
done
export PYTHONPATH="$NEW"
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
