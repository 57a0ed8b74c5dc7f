#!/usr/bin/env bash
# Session 20, call 6 (trimmed to the device time left): after the ready-point fixes (a persistent pinned buffer per
# device; a counter's zeroing marks it), fewer launches per given-amax check, and MXFP4 quantize of bf16 by packed
# bf16x2 pairs (quant_mx_triton): the GPU tests of the checks, the Megatron GPU model, and the MXFP4 / deferred /
# given-amax cases of test_quant_triton.py and test_kv_write.py; MXFP4 quantize timed (and its index path); the
# training step, also with the stream drained before the check (+drain: the old read) in the same rounds.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short tests/gpu/test_checks_gpu.py \
    tests/gpu/test_megatron_gpu.py tests/kernels/test_kv_write.py tests/kernels/test_quant_triton.py \
    -k "checks or megatron or mxfp4 or deferred or given" > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"
timeout 30 python3 benchmarks/bench_quant.py --ops "quantize_mxfp4,copy" > "$OUT/quant_mxfp4.json" 2> "$OUT/quant.err"
grep -v "_checked\|deferred" "$OUT/quant.err"
timeout 100 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 5 --gc manual --drain > "$OUT/qat_step.json" 2> "$OUT/qat_step.err"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['step_ms']); print(d['round_ratio_median'])" \
    "$OUT/qat_step.json"
