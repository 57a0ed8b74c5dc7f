#!/usr/bin/env bash
# A tiny Qwen3-MoE-like GPT trained by Megatron-LM's pretrain_gpt.py (patched: patches/README.md) on mock data, one
# GPU. Usage: MEGATRON_LM=/path/to/patched/Megatron-LM bash examples/megatron_lm/pretrain_tiny_moe.sh [flags...]
# The extra flags are appended, e.g. --trace-fp4 (TRACE's FP4 QAT experts + KV site) or --train-iters 50.
# Transformer Engine and apex are not needed: --transformer-impl local and the fusions that need them off. Without
# TE, megatron-core 0.16.1's MoE router reads moe_utils.te_general_gemm, which only TE defines (NameError at the
# first forward; TRACE's experts refuse to build): this script then defines it as None in every process of the
# launch, through a sitecustomize.py put first on PYTHONPATH
# (megatron_trace.testing.megatron_cpu.fix_router_without_te; it shadows any other sitecustomize).
set -euo pipefail
MEGATRON_LM="${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout at core_v0.16.1 with the TRACE patch applied}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
MODEL=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2
    --kv-channels 64 --seq-length 512 --max-position-embeddings 512 --normalization RMSNorm --swiglu
    --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 --ffn-hidden-size 1024
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-enable-routing-replay)
TRAIN=(--micro-batch-size 2 --global-batch-size 8 --train-iters 30 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
    --lr-warmup-iters 5 --clip-grad 1.0 --bf16 --seed 1234)
IMPL=(--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion
    --no-persist-layer-norm)
DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 99,1,0 --eval-iters 0
    --eval-interval 1000000 --log-interval 1 --log-throughput)
if ! python3 -c "import transformer_engine" 2> /dev/null; then
    SHIM="$(mktemp -d)"; trap 'rm -rf "$SHIM"' EXIT
    printf '%s\n' "from megatron_trace.testing.megatron_cpu import fix_router_without_te" "fix_router_without_te()" \
        > "$SHIM/sitecustomize.py"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
cd "$MEGATRON_LM"
torchrun --nproc-per-node 1 --master-port "${MASTER_PORT:-29512}" pretrain_gpt.py \
    "${MODEL[@]}" "${TRAIN[@]}" "${IMPL[@]}" "${DATA[@]}" "$@"
