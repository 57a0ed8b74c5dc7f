# Session 34 call 3: (1) the GPU tests of the Megatron plugin, with the new one of session 34: Megatron's schedule
# over 4 micro-batches in one trace_guidance context, host guidance copied per layer as it runs, full recompute
# (test_one_context_over_the_schedule_with_host_guidance); (2) call 2's training-step A/B again with a third arm,
# session 33's end (a808572), to place the guided step's +1-2% of call 2 (session 33's fixes, or session 34's
# micro-batch queue). Carry .whl build/ab_s32 build/ab_s33.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
MEGATRON_TRACE_METRICS="$OUT/metrics.jsonl" timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/gpu/test_megatron_gpu.py 2>&1 | tail -8
NEW="$PYTHONPATH"
declare -A PATHS=([s32]="/tmp/site:$PWD/build/ab_s32:$PWD/benchmarks" [s33]="/tmp/site:$PWD/build/ab_s33:$PWD/benchmarks"
                  [head]="$NEW")
rep=0
for order in "s32 s33 head" "head s32 s33" "s33 head s32"; do
  rep=$((rep + 1))
  for arm in $order; do
    if [ "$SECONDS" -gt "${STOP_S:-330}" ]; then echo "skip $arm r$rep (${SECONDS}s)"; continue; fi
    export PYTHONPATH="${PATHS[$arm]}"
    timeout 60 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
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
