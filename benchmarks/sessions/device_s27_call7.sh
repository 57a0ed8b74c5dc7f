#!/usr/bin/env bash
# Session 27, call 7: the final wgmma GEMM (one m64n256k16 per k16 step on 256-token tiles): its GPU tests and the
# dispatch's, then 128 / 192 / 256 tokens per expert on Qwen3's FC1 / FC2 against bf16 and Triton, and 256 on
# DeepSeek-V3's FC1.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs --tb=short tests/gpu/test_moe_wgmma_gpu.py \
    tests/kernels/test_moe_wgmma.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
timeout 200 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 128,192,256 \
    > "$OUT/bench_final.json" 2> "$OUT/bench_final.err"; echo "bench rc=$? after ${SECONDS}s"
timeout 150 python3 benchmarks/bench_moe_wgmma.py --shapes dsv3_fc1 --tokens 256 --tiles 256 \
    > "$OUT/bench_dsv3.json" 2> "$OUT/bench_dsv3.err"; echo "bench dsv3 rc=$? after ${SECONDS}s"
cut -c1-700 "$OUT/bench_final.err" | tail -6; tail -1 "$OUT/bench_dsv3.err" | cut -c1-600
