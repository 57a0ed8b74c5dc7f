#!/usr/bin/env bash
# Session 22, call 1: the GPU tests session 21 left unrun (the MoE GEMM, rollout and KV-write tests after the host
# cdiv change; Megatron's experts with expert_weights.of) and the absmax pass in reverse block order; host time per
# call (the experts' weight list: getattr against expert_weights.of); the quantize ops that read an amax pass first;
# the training step once plainly and once with --gaps.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 --maxfail=20 -rf --tb=short tests/kernels/test_moe_triton.py \
    tests/gpu/test_rollout_gpu.py tests/gpu/test_kv_write_gpu.py tests/gpu/test_megatron_gpu.py \
    tests/kernels/test_quant_triton.py -k "test_moe_triton or rollout or kv_write or megatron or absmax or stacked or tensor" \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"; gzip "$OUT/pytest.txt"
timeout 90 python3 benchmarks/bench_host_overhead.py --cprofile fake_quant_rows > "$OUT/host_overhead.json" \
    2> "$OUT/err.txt"; grep us/call "$OUT/err.txt"
timeout 90 python3 benchmarks/bench_quant.py --ops "stacked,given_amax,tensor(2" > "$OUT/quant.json" 2>> "$OUT/err.txt"
grep "of copy" "$OUT/err.txt" || tail -3 "$OUT/err.txt"
timeout 110 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 10 --gc manual > "$OUT/qat_step_1.json" 2>> "$OUT/err.txt"
python3 benchmarks/step_summary.py "$OUT/qat_step_1.json"
timeout 130 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual --gaps > "$OUT/qat_step_gaps.json" 2>> "$OUT/err.txt"
python3 benchmarks/step_summary.py "$OUT/qat_step_gaps.json" --top 8
gzip "$OUT/err.txt"
