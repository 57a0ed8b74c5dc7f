#!/usr/bin/env bash
# Session 17, call 1: the prefetching grid of pair_kernel (quant_triton.CONFIG "programs_per_sm": a program loops
# over row groups and issues the next group's loads before it rounds the current one). Its GPU tests, then the
# trainer's guided compact + dequant (session 16: 0.635 of copy, its warps waiting on loads), quantize + record
# and RNE fake-quant with and without it (sm_90 build: guided 72 -> 95 registers, record 48 -> 95, fake-quant 72).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 130 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/kernels/test_quant_triton.py \
    -k "prefetch" 2>&1 | tail -4
OPS="guided_compact+dequant(fake,quantize_nvfp4_row+record,fake_quant_rne+ste_mask,copy"
run() {  # name, then --set arguments
    local name=$1; shift
    timeout 60 python3 benchmarks/bench_quant.py --ops "$OPS" "$@" > "$OUT/quant_$name.json" 2> "$OUT/quant.err"
    echo "== $name $*"; grep -v "index path\|_checked\|deferred" "$OUT/quant.err"
}
run base
for n in 4 5 8; do run g$n --set pair_guided.programs_per_sm=$n --set pair.programs_per_sm=$n; done
run g6cap80 --set pair_guided.programs_per_sm=6 --set pair_guided.max_registers=80 --set pair.programs_per_sm=7
run g16 --set pair_guided.programs_per_sm=16 --set pair.programs_per_sm=16
