# Session 42's device calls (carrying .whl), in order; results in benchmarks/results/s42/callN.
# Each call ran one line below from the repo root on the device machine.
# call 1 (asked nvidia-h200, came on an H100; at 222f177, head.txt names the device's stale .git copy):
#   bash benchmarks/sessions/device_next.sh step      # session 40's training-step series, 8 runs, one warm Triton cache
# calls 2-6 (nvidia-h100-x1, an H100; carrying .whl and build/megatron-lm, which is Megatron-LM core_v0.16.1's
#   megatron/{training,legacy,post_training,rl}, pretrain_gpt.py, gpt_builders.py, model_provider.py from
#   `git archive core_v0.16.1`, patched with patches/megatron-lm-core_v0.16.1-trace.patch; .whl gained six and
#   pydantic (+ pydantic_core, annotated_types, typing_inspection) for cp312). Calls 2-5 found what the box lacked:
#   pydantic (call 2), the box's pip list (call 3), the dataset helpers' Makefile (call 4), te_general_gemm (call 5);
#   the script now handles each. Call 6, the runs in benchmarks/results/s42/megatron_lm/:
#   TIMEOUT=170 bash benchmarks/sessions/megatron_lm_runs.sh bf16 fp4 reuse
# calls 7-8 (nvidia-h100-x1, an H100; at fd1f149, build/megatron-lm re-made with the new patch, the one that calls
#   trace_config_from_args first), results in benchmarks/results/s42/megatron_lm_ckpt/ (call 7's fp4.log as
#   fp4_newpatch.log). Call 7's loads failed on Megatron's scheduler check (--train-iters changed), so the loads now
#   pass --override-opt_param-scheduler; its trailing pytest of tests/gpu/test_megatron_gpu.py ran outside
#   _device_env.sh and skipped (not a result). Call 8:
#   TIMEOUT=90 bash benchmarks/sessions/megatron_lm_runs.sh save_bf16 load_fp4 save_fp4 load_bf16
