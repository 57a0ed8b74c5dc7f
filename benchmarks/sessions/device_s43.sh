# Session 43's device calls (carrying .whl), in order; results in benchmarks/results/s43/. Calls 1-4 got no machine
# (each failed start cost 15-180 s of device time). Code at 4277995 (head.txt names the device's stale .git copy).
# .whl: ../shared/tools/gpu-wheels.sh megatron-core==0.16.1 mbridge==0.15.1 einops psutil hydra-core==1.3.2
#   omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 transformers==5.24.0 six pydantic==2.14.4 pydantic_core==2.50.5
#   annotated_types typing_inspection
#   (transformers 5.24.0, not 5.25: 5.25 needs huggingface-hub >= 2.4 and the box has 1.33; call 6 had 5.25)
# call 5 (nvidia-h200, an H200), results in call5_step/:
#   bash benchmarks/sessions/device_next.sh step      # session 40's training-step series, 8 runs, one warm Triton cache
# call 6 (the same warm H200), results in call6_suite/: 1329 passed, 19 skipped; 1 failed and 11 errors, all
#   transformers 5.25's ImportError (huggingface-hub 1.33 on the box):
#   bash benchmarks/sessions/device_next.sh suite
# call 7: the same rerun as call 8, but pip --target left call 6's transformers 5.25 in /tmp/site (not a result;
#   the device scripts now empty /tmp/site before installing). Call 8, results in call8_rerun/ (506 passed):
#   rm -rf /tmp/site; source benchmarks/_device_env.sh; python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs \
#     tests/gpu/test_kv_attention_gpu.py tests/gpu/test_kv_write_gpu.py tests/gpu/test_moe_combine_gpu.py \
#     tests/gpu/test_moe_routing_gpu.py tests/gpu/test_rollout_gpu.py tests/kernels/test_kv_write.py \
#     tests/kernels/test_moe_routing.py tests/kernels/test_rollout_finite.py tests/gpu/test_rl_driver_gpu.py \
#     tests/kernels/test_kv_attention.py
# call 9 (asked nvidia-h200, came on an H100), results in call9_gaps_h100/: the step series with --gaps (one
#   profiled step per variant after the timed rounds: GPU busy / idle time and the host ops that launched late):
#   source benchmarks/_device_env.sh; export TRITON_CACHE_DIR=/tmp/tc; for run in 1 2 3; do
#     python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
#       --kernels auto --warmup 2 --reps 8 --gc manual --gaps | sed "s/^{/{\"run\": $run, /" >> $OUT/gaps.jsonl; done
