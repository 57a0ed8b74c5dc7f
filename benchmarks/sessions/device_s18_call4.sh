#!/usr/bin/env bash
# Session 18, call 4 (call 3: test_triton_fp4.py alone, after its input fix): guided compact + dequant (0.795 of
# copy in call 2) and quantize + record at a few other launch configs, and the defaults twice.
source benchmarks/_device_env.sh > /dev/null 2>&1
exec > >(tee -a "$OUT/log.txt") 2>&1
OPS="quantize_nvfp4_row+record,guided_compact+dequant(fake-quant fwd),copy"
run() {
    local name=$1; shift
    timeout 40 python3 benchmarks/bench_quant.py --ops "$OPS" "$@" > "$OUT/quant_$name.json" 2> "$OUT/quant.err"
    echo "== $name $*"; grep -v "index path\|_checked\|deferred" "$OUT/quant.err"
}
run base
run w2 --set pair_guided.num_warps=2 --set pair.num_warps=1
run t4096w8 --set pair_guided.tile=4096 --set pair_guided.num_warps=8 --set pair.tile=4096 --set pair.num_warps=4
run base2
