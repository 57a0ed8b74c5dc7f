#!/usr/bin/env bash
# Session 21, call 3: the torch experts' weights packed side by side (megatron/expert_weights.py): the grouped GEMM
# and the fake-quant read them as one [E, M, K] view, no torch.stack copy per forward. The Megatron GPU tests, then
# the training step: twice for timing (the first with Megatron's stock experts too), once with --gaps.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 --maxfail=20 -rf --tb=short tests/gpu/test_megatron_gpu.py \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"; gzip "$OUT/pytest.txt"
for i in 1 2; do
  v=bf16_grouped,fp4_qat,trace_guided; [ $i = 1 ] && v=bf16_stock,$v
  timeout 150 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants $v \
      --kernels auto --warmup 2 --reps 8 --gc manual > "$OUT/qat_step_$i.json" 2>> "$OUT/err.txt"
  python3 -c "import json; d=json.load(open('$OUT/qat_step_$i.json')); print(d['step_ms'], d['round_ratio_median'])"
done
timeout 150 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual --gaps > "$OUT/qat_step_gaps.json" 2>> "$OUT/err.txt"
python3 - "$OUT/qat_step_gaps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["step_ms"], d["round_ratio_median"])
for k, g in d["gaps"].items():
    print("==", k, {x: g[x] for x in ("span_ms", "busy_ms", "idle_ms", "gaps_over_min_ms", "host_late_ms")})
    for row in g["by_launching_op"][:6]:
        print("   ", row)
PY
gzip "$OUT/err.txt"
