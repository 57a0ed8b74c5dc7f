#!/usr/bin/env bash
# Session 22, call 2: the GPU test files call 1's 240 s cut may have left unfinished (MoE GEMM, rollout, KV write,
# Megatron); the host time of one pair_kernel launch by Triton's JIT path against the compiled kernel called
# directly (probe_launch_path.py); where the experts' stacked weights spend host time (cProfile); one guided
# training step's host time by Python function (--host-profile).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 --maxfail=20 -rf --tb=short tests/kernels/test_moe_triton.py \
    tests/gpu/test_rollout_gpu.py tests/gpu/test_kv_write_gpu.py tests/gpu/test_megatron_gpu.py > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"; gzip "$OUT/pytest.txt"
timeout 60 python3 benchmarks/probe_launch_path.py > "$OUT/launch_path.json" 2> "$OUT/err.txt"; cat "$OUT/launch_path.json"
timeout 90 python3 benchmarks/bench_host_overhead.py --calls 1000 \
    --cprofile "expert_weights.stacked (128; with gradient),fake_quant_weights" > "$OUT/host_overhead.json" \
    2>> "$OUT/err.txt"; grep us/call "$OUT/err.txt"
timeout 120 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 4 --gc manual --host-profile > "$OUT/qat_step_host.json" 2>> "$OUT/err.txt"
python3 benchmarks/step_summary.py "$OUT/qat_step_host.json"
gzip "$OUT/err.txt"
