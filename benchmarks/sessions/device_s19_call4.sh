#!/usr/bin/env bash
# Session 19, call 4 (run inline, on the machine warm from call 3): MXFP4 quantize at 2 warps (tile 4096 and 8192),
# then test_kv_write.py and tests/gpu/ at this session's kernels.
source benchmarks/_device_env.sh > /dev/null 2>&1
for v in "pair_mxfp4.num_warps=2" "pair_mxfp4.tile=8192"; do
    timeout 30 python3 benchmarks/bench_quant.py --ops "quantize_mxfp4,copy" --set pair_mxfp4.num_warps=2 \
        --set "$v" > "$OUT/mx_${v//[.=]/_}.json" 2> "$OUT/mx.err"
    echo "== 2 warps, $v"; grep -v "_checked\|deferred\|dequant" "$OUT/mx.err"
done
timeout 330 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short tests/kernels/test_kv_write.py \
    tests/gpu > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head; tail -1 "$OUT/pytest.txt"
