# Session 35 call 3: the driver's GPU test at the final code (fp32 gradient accumulation, tightened tolerances),
# then where a micro-batched trainer pass's time goes on the GPU main job's config (256 rows; 1, 4, 8 micro-batches).
source benchmarks/_device_env.sh
MEGATRON_TRACE_METRICS="$OUT/metrics.jsonl" timeout 200 python3 -m pytest -v -p no:cacheprovider -rfEs --tb=long \
    -p no:warnings tests/gpu/test_rl_driver_gpu.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; tail -5 "$OUT/pytest.txt"
timeout 300 python3 benchmarks/bench_driver_microbatches.py --config gpu --device cuda --arms bf16,trace \
    --mbs 256,64,32 --reps 5 > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
echo "bench rc=$? after ${SECONDS}s"; tail -3 "$OUT/bench.err"
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["arm"], r["wall_s"], r["fit"])
    for t in r["top_own_time"][:10]:
        print("   ", t)
PY
