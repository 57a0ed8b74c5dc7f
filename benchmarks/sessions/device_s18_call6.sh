#!/usr/bin/env bash
# Session 18, call 6: guided compact's z != 0 test against RD(sf * 2**-150) (a subnormal whose bits are
# floor(sf / 2)) instead of |a| * 2**100 against sf * 2**-50: one multiply per element less. The three ops at the
# defaults, then the guided and fake-quant cases of test_quant_triton.py on the GPU.
source benchmarks/_device_env.sh > /dev/null 2>&1
exec > >(tee -a "$OUT/log.txt") 2>&1
OPS="quantize_nvfp4_row+record,guided_compact+dequant(fake-quant fwd),guided_compact->codes,copy"
timeout 40 python3 benchmarks/bench_quant.py --ops "$OPS" > "$OUT/quant_base.json" 2> "$OUT/quant.err"
grep -v "index path\|_checked\|deferred" "$OUT/quant.err"
timeout 130 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short \
    tests/kernels/test_quant_triton.py -k "guided or fake" > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
