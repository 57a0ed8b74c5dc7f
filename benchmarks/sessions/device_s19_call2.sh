#!/usr/bin/env bash
# Session 19, call 2: guided full + dequant by magnitudes (quant_guided_triton.guided_full_tile: the record's codes
# as one 64-bit load per block, the rollout's pick by the directed sums' grid index) against its index path; the
# other guided ops and quantize + record at 1 and 2 warps (twice each); then the guided GPU tests and
# test_triton_fp4.py.
source benchmarks/_device_env.sh > /dev/null 2>&1
exec > >(tee -a "$OUT/log.txt") 2>&1
OPS="guided_full+dequant,guided_compact+dequant(fake-quant fwd),guided_compact->codes,quantize_nvfp4_row+record,copy"
timeout 60 python3 benchmarks/bench_quant.py --ops "$OPS" > "$OUT/quant_base.json" 2> "$OUT/quant.err"
grep -v "_checked\|deferred" "$OUT/quant.err"
python3 - > "$OUT/full_index.json" 2> "$OUT/full_index.err" <<'PY'
import sys; sys.argv = ["bench_quant.py", "--ops", "guided_full+dequant,copy"]
sys.path.insert(0, "benchmarks")
from megatron_trace.kernels import quant_triton as qk
qk.GUIDED_BY_MAGNITUDE = False
import bench_quant; bench_quant.main()
PY
echo "== guided full, index path"; grep -v "_checked\|deferred" "$OUT/full_index.err" | tail -3
for v in "pair.num_warps=1" "pair.num_warps=2" "pair.num_warps=1" "pair.num_warps=2"; do
    timeout 40 python3 benchmarks/bench_quant.py --ops "quantize_nvfp4_row+record,copy" --set "$v" \
        > "$OUT/quant_${v//[.=]/_}.json" 2> "$OUT/quant.err"; echo "== $v"; grep -v "_checked\|deferred" "$OUT/quant.err"
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short \
    tests/kernels/test_triton_fp4.py tests/kernels/test_quant_triton.py -k "guided or full or fake or triton_fp4" \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
