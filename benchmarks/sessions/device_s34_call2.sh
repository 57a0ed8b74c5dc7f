# Session 34 call 2: the training step (session 23's protocol: bench_qat_step.py --preset qwen3-30b-a3b, BF16 vs
# plain FP4 QAT vs TRACE guided) at session 32's end (1ef2a47, before session 33's fixes: ste_clip on recording
# steps, the guidance checks) and at HEAD (+ session 34's per-micro-batch queue: every layer's forward now
# selects its step through a pre-hook). Rounds alternate the arms' order. Carry .whl build/ab_s32.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
NEW="$PYTHONPATH"
declare -A PATHS=([s32]="/tmp/site:$PWD/build/ab_s32:$PWD/benchmarks" [head]="$NEW")
rep=0
for order in "s32 head" "head s32" "s32 head" "head s32"; do
  rep=$((rep + 1))
  for arm in $order; do
    if [ "$SECONDS" -gt "${STOP_S:-450}" ]; then echo "skip $arm r$rep (${SECONDS}s)"; continue; fi
    export PYTHONPATH="${PATHS[$arm]}"
    timeout 120 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
        --kernels auto --warmup 2 --reps 8 --gc manual 2>> "$OUT/qat.err" \
        | sed "s/^{/{\"arm\": \"$arm\", \"round\": $rep, /" >> "$OUT/qat.jsonl"
    echo "$arm r$rep rc=${PIPESTATUS[0]} at ${SECONDS}s"
  done
done
export PYTHONPATH="$NEW"
python3 - "$OUT/qat.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["arm"], r["round"], r["step_ms"], r.get("round_ratio_median"))
PY
