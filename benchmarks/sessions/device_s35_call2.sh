# Session 35 call 2: the RL driver's trainer step over Megatron's schedule on CUDA.
# 1. tests/gpu/test_rl_driver_gpu.py (4 micro-batches vs 1: log-probs, gradients, rows, guided codes; a whole
#    micro-batched guided step), its measured differences in $OUT/metrics.jsonl;
# 2. the GPU main job (examples/conf/gpu.yaml: 256 rows per step) with rl.micro_batch_size=0 (one micro-batch) and
#    32 (8 micro-batches), arms bf16 and trace, 6 steps, 2 rounds alternating: time/train_s per step.
source benchmarks/_device_env.sh
MEGATRON_TRACE_METRICS="$OUT/metrics.jsonl" timeout 240 python3 -m pytest -v -p no:cacheprovider -rfEs --tb=long \
    -p no:warnings tests/gpu/test_rl_driver_gpu.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; tail -5 "$OUT/pytest.txt"
for r in 1 2; do for m in 0 32; do
  timeout 200 python3 examples/rl_demo.py --config-name gpu run_name=mb${m}_r$r rl.steps=6 arms=[bf16,trace] \
      sft.steps=100 rl.eval_problems=64 progress=false rl.micro_batch_size=$m > "/tmp/mb${m}_r$r.log" 2>&1
  echo "mb=$m round=$r rc=$? after ${SECONDS}s"; tail -2 "/tmp/mb${m}_r$r.log"
  cp "outputs/mb${m}_r$r/metrics.jsonl" "$OUT/mb${m}_r$r.jsonl" 2>/dev/null
done; done
python3 - "$OUT" <<'PY'
import json, statistics, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "mb*_r*.jsonl"))):
    rows = [json.loads(l) for l in open(f)]
    for arm in ("bf16", "trace"):
        t = [r["time/train_s"] for r in rows if r.get("arm") == arm][1:]
        d = [r["mismatch/logprob_abs_diff"] for r in rows if r.get("arm") == arm]
        if t:
            print(os.path.basename(f), arm, "train_s median(steps 1-5)", round(statistics.median(t), 4),
                  "mismatch mean", round(sum(d) / len(d), 6))
PY
