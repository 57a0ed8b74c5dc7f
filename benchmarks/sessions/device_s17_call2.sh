#!/usr/bin/env bash
# Session 17, call 2: the RNE tile's block scales by the GPU's E4M3 conversion and a Markstein division by 6
# (triton_fp4.nvfp4_block_scale_hw; sm_90 build of quantize + record: ~26 fewer instructions per block) and the
# prefetching grid on by default for guided compact (8 programs per multiprocessor, call 1's best). All of
# test_quant_triton.py (a new test: every E4M3 rounding boundary of the block scales), then quantize + record,
# guided compact + dequant and RNE fake-quant: as they are, without the prefetch, and with 1 or 2 warps per row
# for the RNE kernels (sm_90 fast path: 24.6 / 28.0 instead of 34.0 SASS per element, 128 / 64 registers), twice each;
# the RNE tile on the GPU also skips the tile-wide Inf check where it computes the row amax (S_enc = 0 flags it).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 14 -rf --tb=short tests/kernels/test_quant_triton.py 2>&1 | tail -4
OPS="guided_compact+dequant(fake,quantize_nvfp4_row+record,fake_quant_rne+ste_mask,copy"
run() {  # name, then --set arguments
    local name=$1; shift
    timeout 60 python3 benchmarks/bench_quant.py --ops "$OPS" "$@" > "$OUT/quant_$name.json" 2> "$OUT/quant.err"
    echo "== $name $*"; grep -v "index path\|_checked\|deferred" "$OUT/quant.err"
}
for rep in 1 2; do
    run base_$rep
    run noprefetch_$rep --set pair_guided.programs_per_sm=0
    run w2_$rep --set pair.num_warps=2
    run w1_$rep --set pair.num_warps=1
done
run w1cap96 --set pair.num_warps=1 --set pair.max_registers=96
