# Session 41's device calls (nvidia-h200 asked, an H100 came; carrying .whl), in order; results in benchmarks/results/s41/.
# 1. bash benchmarks/device_tests.sh (at 10c8404): 1743 passed, 2 failed (the graph cases of the new NaN test: the
#    test's own hook wrote its NaN by an indexed scalar assignment, which a CUDA graph capture refuses)
# 2. the rollout tests at 50bcf9e (the hook writes with fill_):
#    pytest -n 8 tests/gpu/test_rollout_gpu.py tests/kernels/test_rollout_finite.py tests/rollout/test_finite.py
# 3. decode_ab: the decode step before (fa8cda4, no NaN/Inf counting at the rollout's quantize sites) and after
#    (HEAD), FP4, at the fixed round order; carry build/ab_s40, made by
#      mkdir -p build/ab_s40 && git archive fa8cda4 megatron_trace | tar -x -C build/ab_s40
decode_ab() {
    source benchmarks/_device_env.sh > /dev/null 2>&1
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
    local new="$PYTHONPATH" old="/tmp/site:$PWD/build/ab_s40:$PWD/benchmarks"
    for order in "old new" "new old" "old new"; do
        rep=$((${rep:-0} + 1))
        for arm in $order; do
            if (( SECONDS + 110 > ${BUDGET:-560} )); then echo "stop before $arm r$rep at ${SECONDS}s"; break 2; fi
            [[ $arm == old ]] && export PYTHONPATH="$old" || export PYTHONPATH="$new"
            timeout 110 python3 benchmarks/bench_decode.py --modes fp4 --batches 64,8 --lengths 1024,8192 \
                --steps 8 --graph-reps 20 2>> "$OUT/decode.err" \
                | sed "s/^{/{\"arm\": \"$arm\", \"round\": $rep, /" >> "$OUT/decode.jsonl"
            echo "$arm r$rep rc=${PIPESTATUS[0]} at ${SECONDS}s"
        done
    done
    export PYTHONPATH="$new"
}
[[ "${BASH_SOURCE[0]}" == "$0" ]] && "${1:?name a call: decode_ab}"
