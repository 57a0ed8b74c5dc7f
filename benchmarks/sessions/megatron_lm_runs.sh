#!/usr/bin/env bash
# Megatron-LM's own launcher with the TRACE patch, on the device box (one GPU; carry .whl and build/megatron-lm).
# build/megatron-lm: Megatron-LM core_v0.16.1's megatron/{training,legacy,post_training,rl}, pretrain_gpt.py,
# gpt_builders.py and model_provider.py, patched with patches/megatron-lm-core_v0.16.1-trace.patch (git archive of
# the tag + `patch -p1`: git apply inside this repository skips the paths); megatron.core comes from the
# megatron-core 0.16.1 wheel. Runs: bash <this> [VARIANT...]
#   bf16   the stock spec                    fp4   --trace-fp4 (plain FP4 QAT: pretrain_gpt.py has no rollout)
#   reuse  --trace-fp4 --trace-reuse-weight-quant (the experts' weights fake-quantized once per step)
#   save_bf16 load_fp4 / save_fp4 load_bf16: a stock checkpoint resumed with --trace-fp4, and the reverse
#   eval_fp4  --trace-fp4 with an evaluation every 10 iterations (the patched evaluate's trace_eval_done)
#   dist_fp4 / overlap_fp4: --trace-fp4 with the distributed optimizer and --overlap-grad-reduce, without and with
#             --overlap-param-gather (the torch experts run their linears' DDP pre-hooks; one GPU: a 1-rank gather)
source benchmarks/_device_env.sh > /dev/null 2>&1
export MEGATRON_LM="$PWD/build/megatron-lm"
# Megatron-LM's launcher runs `make` in megatron/core/datasets (compile_helpers); the wheel ships helpers_cpp built
# but no Makefile: a no-op one (a Megatron-LM checkout's own megatron/core builds it with pybind11 instead)
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
# Megatron-Core 0.16.1's MoE router reads moe_utils.te_general_gemm, which exists only when Transformer Engine imports
# (NameError without TE; the box has no TE): defined as None at start-up, as benchmarks/_megatron.py does
mkdir -p /tmp/shim && printf '%s\n' "from megatron_trace.testing.megatron_cpu import fix_router_without_te" \
    "fix_router_without_te()" > /tmp/shim/sitecustomize.py
export PYTHONPATH="/tmp/shim:$PYTHONPATH"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
CK=/tmp/megatron_lm_ckpt  # save_X then load_Y: a dist checkpoint (torch_dist) of iteration 30 resumed to 40
declare -A FLAGS=([bf16]="" [fp4]="--trace-fp4" [reuse]="--trace-fp4 --trace-reuse-weight-quant"
    [save_bf16]="--save $CK/bf16 --save-interval 30" [load_fp4]="--trace-fp4 --load $CK/bf16 --train-iters 40 --override-opt_param-scheduler"
    [save_fp4]="--trace-fp4 --save $CK/fp4 --save-interval 30" [load_bf16]="--load $CK/fp4 --train-iters 40 --override-opt_param-scheduler"
    [eval_fp4]="--trace-fp4 --eval-iters 2 --eval-interval 10"
    [dist_fp4]="--trace-fp4 --use-distributed-optimizer --overlap-grad-reduce"
    [overlap_fp4]="--trace-fp4 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
for v in "${@:-bf16 fp4 reuse}"; do
    for variant in $v; do
        start=$SECONDS
        # shellcheck disable=SC2086
        timeout "${TIMEOUT:-170}" bash examples/megatron_lm/pretrain_tiny_moe.sh ${FLAGS[$variant]} \
            > "$OUT/$variant.log" 2>&1
        rc=$?
        echo "$variant rc=$rc in $((SECONDS - start))s; $(grep -c 'lm loss' "$OUT/$variant.log") logged iterations"
        grep -E "Error|error:" "$OUT/$variant.log" | grep -v Warning | head -5
    done
done
