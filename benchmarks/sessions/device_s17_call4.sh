#!/usr/bin/env bash
# Session 17, call 4: with call 3's compile error fixed (the dequantize kernel's _needs_exact call) and the new
# defaults (guided compact: the prefetching grid, 8 programs per multiprocessor; RNE fake-quant: its own config,
# "pair_fake", 2 warps). All of test_quant_triton.py, then the whole bench_quant.py at the defaults, then guided
# compact + dequant with 2 warps (with and without the prefetching grid).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 14 --maxfail=20 -rf --tb=short \
    tests/kernels/test_quant_triton.py > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
timeout 90 python3 benchmarks/bench_quant.py > "$OUT/quant_all.json" 2> "$OUT/quant.err"; cat "$OUT/quant.err"
OPS="guided_compact+dequant(fake,copy"
for n in 8 0; do
    timeout 40 python3 benchmarks/bench_quant.py --ops "$OPS" --set pair_guided.num_warps=2 \
        --set pair_guided.programs_per_sm=$n > "$OUT/quant_guided_w2_p$n.json" 2> "$OUT/quant.err"
    echo "== guided 2 warps, programs_per_sm=$n"; cat "$OUT/quant.err"
done
