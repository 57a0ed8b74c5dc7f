# Session 36 call 2 (to run when a device is lent): where a micro-batched trainer pass's time goes on the GPU main
# job's config (256 rows; 1, 4, 8 micro-batches): wall time, its fit per micro-batch and cProfile's top functions;
# then the dispatched operators per pass and module (--count-ops; each a kernel launch on the GPU).
source benchmarks/_device_env.sh
timeout 280 python3 benchmarks/bench_driver_microbatches.py --config gpu --device cuda --arms bf16,trace \
    --mbs 256,64,32 --reps 5 > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
echo "bench rc=$? after ${SECONDS}s"; tail -3 "$OUT/bench.err"
timeout 200 python3 benchmarks/bench_driver_microbatches.py --config gpu --device cuda --arms bf16,trace \
    --mbs 256,32 --reps 1 --top 5 --count-ops > "$OUT/ops.jsonl" 2> "$OUT/ops.err"
echo "ops rc=$? after ${SECONDS}s"; tail -3 "$OUT/ops.err"
python3 - "$OUT/bench.jsonl" "$OUT/ops.jsonl" <<'PY'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        print(r["arm"], r["wall_s"], r["fit"], r.get("ops", ""))
        for t in r["top_own_time"][:10]:
            print("   ", t)
PY
