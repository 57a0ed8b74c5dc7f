#!/usr/bin/env bash
# Session 18, call 2: after call 1, the defaults are quantize + record with 2 warps ("pair") and guided compact
# without the prefetching grid ("pair_guided"); since call 1 the block amax is one packed bf16 max per word, the
# block scales are stored by byte stores in place (no shared-memory move with 2 blocks per thread) and a one-row
# program loads without clamping. The three ops at the defaults and at the alternatives, then the GPU tests of the
# changed kernels: test_triton_fp4.py (the GPU-only instructions against their portable forms), all of
# test_quant_triton.py, the FP4 KV cache's writes (they round through the changed RNE tile) and tests/gpu.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
OPS="quantize_nvfp4_row+record,guided_compact+dequant(fake-quant fwd),fake_quant_rne+ste_mask,copy"
run() {  # name, then --set arguments
    local name=$1; shift
    timeout 50 python3 benchmarks/bench_quant.py --ops "$OPS" "$@" > "$OUT/quant_$name.json" 2> "$OUT/quant.err"
    echo "== $name $*"; grep -v "index path\|_checked\|deferred" "$OUT/quant.err"
}
run base
run alt --set pair.num_warps=4 --set pair_guided.programs_per_sm=8
timeout 440 python3 -m pytest -q -p no:cacheprovider -n 15 --maxfail=20 -rf --tb=short \
    tests/kernels/test_triton_fp4.py tests/kernels/test_quant_triton.py tests/kernels/test_kv_write.py tests/gpu/ \
    > "$OUT/pytest.txt" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | sed 's/ - .*//' | head -20; tail -1 "$OUT/pytest.txt"
