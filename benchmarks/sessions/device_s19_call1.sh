#!/usr/bin/env bash
# Session 19, call 1: the whole bench_quant.py with recip_rn as MUFU.RCP and one Newton step (no out-of-range call:
# quantize + record builds with 40 registers instead of 71) and session 18's last change (guided compact's z != 0
# test against RD(sf * 2**-150)); then test_triton_fp4.py and all of test_quant_triton.py; then quantize + record's
# launch configs again at 40 registers.
source benchmarks/_device_env.sh > /dev/null 2>&1
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 90 python3 benchmarks/bench_quant.py > "$OUT/quant_all.json" 2> "$OUT/quant.err"
grep -v "index path\|_checked\|deferred" "$OUT/quant.err"
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short \
    tests/kernels/test_triton_fp4.py tests/kernels/test_quant_triton.py > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
OPS="quantize_nvfp4_row+record,copy"
for v in "pair.num_warps=4" "pair.num_warps=1" "pair.tile=4096"; do
    timeout 40 python3 benchmarks/bench_quant.py --ops "$OPS" --set "$v" > "$OUT/quant_${v//[.=]/_}.json" \
        2> "$OUT/quant.err"; echo "== $v"; grep -v "index path\|_checked\|deferred" "$OUT/quant.err"
done
