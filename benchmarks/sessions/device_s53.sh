#!/usr/bin/env bash
# Session 53: the checked quantize ops at this session's kernels (int64 NaN/Inf counters; the word-pair kernel counts
# values in a tile that has one) against session 52's (the files of 0f25316), same machine, same call, twice each
# in alternating order. Run from the repo root on the GPU box (carry .whl): bash benchmarks/sessions/device_s53.sh
source benchmarks/_device_env.sh > /dev/null 2>&1
OPS="record_checked,record_deferred_check,stacked_weights,given_amax_weights,quantize_nvfp4_row+record"
FILES="megatron_trace/kernels/quant_pair_triton.py megatron_trace/kernels/checks.py megatron_trace/kernels/fused.py"
mkdir -p /tmp/new && for f in $FILES; do cp "$f" /tmp/new/; done
for round in 1 2; do
  for code in new old; do
    if [ "$code" = old ]; then git show "0f25316:megatron_trace/kernels/quant_pair_triton.py" > megatron_trace/kernels/quant_pair_triton.py
      git show 0f25316:megatron_trace/kernels/checks.py > megatron_trace/kernels/checks.py
      git show 0f25316:megatron_trace/kernels/fused.py > megatron_trace/kernels/fused.py
    else for f in $FILES; do cp "/tmp/new/$(basename "$f")" "$f"; done; fi
    python3 benchmarks/bench_quant.py --ops "$OPS" | sed "s/^/{\"code\": \"$code\", \"round\": $round, \"row\": /; s/\$/}/" \
      >> "$OUT/checked_ops.jsonl"
  done
done
for f in $FILES; do cp "/tmp/new/$(basename "$f")" "$f"; done
wc -l "$OUT/checked_ops.jsonl"
