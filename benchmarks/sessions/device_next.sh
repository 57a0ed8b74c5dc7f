#!/usr/bin/env bash
# Proposed for the next session with a device (sessions 31-33 could not run it: no device time left in 31, no
# device lent in 32 and 33). Carry .whl, build/ab_s30 and build/ab_s31, made by
#   for c in 2f30281:ab_s30 ff954f8:ab_s31; do d=build/${c#*:}; rm -rf $d; mkdir -p $d
#     git archive ${c%:*} megatron_trace | tar -x -C $d; done
# 1. The GPU tests of the code changed since the last GPU run: session 31's 914fa7e (RowWriter.takes) and 6d02457
#    (cuda_launch.params), session 32's FP4 KV prefill read from the quantize pass (test_kv_write.py's
#    test_prefill_reads_its_rows_from_the_quantize_pass, and the rollout's bits against the reference).
# 2. The prefill's host time by module at session 30's end (2f30281), session 31's end (ff954f8) and HEAD: 3 rounds,
#    the arms' order rotated each round, 5 timed generates per run (the median prefill; BF16 beside it as the
#    machine's control). Session 31's call 3 read the FP4 prefill at 39.1-39.8 ms for 2f30281 and 39.3-54.7 ms
#    for session 31's code in single samples.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_cuda_launch_gpu.py \
    tests/gpu/test_kv_write_gpu.py tests/kernels/test_kv_write.py tests/gpu/test_rollout_gpu.py 2>&1 | tail -6
# session 33's kernel entry-point fixes on the GPU path (strided per-tensor amax, zero rows, deferred NaN with a
# per-tensor amax, a record of another format, dequantize dtypes, the MoE GEMM's dtype, decode attention lengths
# past T / an empty history / K and V formats; the one-token prefill is in test_rollout_gpu)
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/kernels/test_quant_triton.py \
    tests/kernels/test_moe_triton.py tests/kernels/test_kv_attention.py \
    -k "non_contiguous or zero_rows or another_format or deferred_nan_stays or other_dtypes or references_dtype \
        or past_the_history or empty_history or different_formats" 2>&1 | tail -4
NEW="$PYTHONPATH"
declare -A PATHS=([s30]="/tmp/site:$PWD/build/ab_s30:$PWD/benchmarks" [s31]="/tmp/site:$PWD/build/ab_s31:$PWD/benchmarks"
                  [new]="$NEW")
for order in "s30 s31 new" "s31 new s30" "new s30 s31"; do
  rep=$((${rep:-0} + 1))
  for arm in $order; do
    export PYTHONPATH="${PATHS[$arm]}"
    timeout 100 python3 benchmarks/profile_step_host.py --batch 32 --prompt 512 --tokens 2 --reps 1 --timed 5 \
        2>> "$OUT/prefill.err" | sed "s/^{/{\"arm\": \"$arm\", \"round\": $rep, /" >> "$OUT/prefill.jsonl"
    echo "$arm r$rep rc=${PIPESTATUS[0]}"
  done
done
export PYTHONPATH="$NEW"
python3 - "$OUT/prefill.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    own = r["prefill_own_ms"]
    print(r["arm"], r["round"], r["mode"], "prefill", r["prefill_host_ms"], r.get("prefill_host_ms_runs"),
          {k: own[k] for k in list(own)[:5]})
PY
