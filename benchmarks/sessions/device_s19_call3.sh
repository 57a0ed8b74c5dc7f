#!/usr/bin/env bash
# Session 19, call 3: the whole bench_quant.py at this session's kernels (guided full by magnitudes with the signs
# and rollout keys from words, 44.5 SASS per element instead of 49; MXFP4 / index-path scale bytes by st.global.u8
# instead of through shared memory); launch configs of MXFP4 quantize and of guided full; then
# test_triton_fp4.py and all of test_quant_triton.py.
source benchmarks/_device_env.sh > /dev/null 2>&1
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 90 python3 benchmarks/bench_quant.py > "$OUT/quant_all.json" 2> "$OUT/quant.err"
grep -v "_checked\|deferred" "$OUT/quant.err"
for v in "pair_mxfp4.tile=2048" "pair_mxfp4.tile=8192" "pair_mxfp4.num_warps=2" "pair_mxfp4.num_warps=8"; do
    timeout 30 python3 benchmarks/bench_quant.py --ops "quantize_mxfp4,copy" --set "$v" \
        > "$OUT/quant_${v//[.=]/_}.json" 2> "$OUT/quant.err"; echo "== $v"; grep -v "_checked\|deferred" "$OUT/quant.err"
done
for v in "pair_guided.num_warps=2" "pair_guided.num_warps=8"; do
    timeout 30 python3 benchmarks/bench_quant.py --ops "guided_full,copy" --set "$v" \
        > "$OUT/quant_${v//[.=]/_}.json" 2> "$OUT/quant.err"; echo "== $v"; grep -v "_checked\|deferred" "$OUT/quant.err"
done
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short \
    tests/kernels/test_triton_fp4.py tests/kernels/test_quant_triton.py > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
