#!/usr/bin/env bash
# Session 21, call 2: ReadyPoint.mark("cuda") now names the GPU's index (the read of call 1's failing test
# waited for the stream: "cuda" != "cuda:0"); host code no longer calls Triton 3.6's constexpr-function cdiv /
# next_power_of_2 (~10 us each on the host). GPU tests of the touched host paths, host time per call, the
# stacked weights' kernels, then the training step three times (timing) and once more with --gaps.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 --maxfail=20 -rf --tb=short tests/gpu/test_checks_gpu.py \
    tests/gpu/test_kv_attention_gpu.py tests/gpu/test_moe_routing_gpu.py tests/kernels/test_moe_slices.py \
    tests/kernels/test_quant_triton.py -k "checks or attention or routing or slices or stacked or deferred or given" \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"; gzip "$OUT/pytest.txt"
timeout 90 python3 benchmarks/bench_host_overhead.py --cprofile fake_quant_rows > "$OUT/host_overhead.json" \
    2> "$OUT/host_overhead.err"; grep us/call "$OUT/host_overhead.err"
timeout 90 python3 benchmarks/bench_quant.py --ops "stacked,given_amax,fake_quant_rne+ste_mask,tensor(2" \
    > "$OUT/quant.json" 2> "$OUT/quant.err"; grep "of copy" "$OUT/quant.err" || tail -3 "$OUT/quant.err"
for i in 1 2 3; do
  timeout 150 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
      --kernels auto --warmup 2 --reps 8 --gc manual > "$OUT/qat_step_$i.json" 2> "$OUT/qat_step_$i.err"
  python3 -c "import json; d=json.load(open('$OUT/qat_step_$i.json')); print(d['step_ms'], d['round_ratio_median'])"
done
timeout 150 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual --gaps > "$OUT/qat_step_gaps.json" 2> "$OUT/qat_step_gaps.err"
python3 - "$OUT/qat_step_gaps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["step_ms"], d["round_ratio_median"])
for k, g in d["gaps"].items():
    print("==", k, {x: g[x] for x in ("span_ms", "busy_ms", "idle_ms", "gaps_over_min_ms", "host_late_ms")})
    for row in g["by_launching_op"][:6]:
        print("   ", row)
PY
