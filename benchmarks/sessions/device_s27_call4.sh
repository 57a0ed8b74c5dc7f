#!/usr/bin/env bash
# Session 27, call 4: the wgmma GEMM's outputs through shared memory as 16-byte stores (call 3: scattered 2-byte
# stores): its GPU tests, then 128 and 256 tokens per expert on Qwen3's FC1 / FC2 (4 and 5 token stages) and 256 on
# DeepSeek-V3's FC1.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_moe_wgmma_gpu.py \
    > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$? after ${SECONDS}s"
grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest.txt" | head -20; tail -2 "$OUT/pytest.txt"
timeout 200 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 128,256 \
    --variants ",XS=5" > "$OUT/bench_wgmma.json" 2> "$OUT/bench_wgmma.err"; echo "bench rc=$? after ${SECONDS}s"
timeout 150 python3 benchmarks/bench_moe_wgmma.py --shapes dsv3_fc1 --tokens 256 --tiles 256 \
    > "$OUT/bench_wgmma_dsv3.json" 2> "$OUT/bench_wgmma_dsv3.err"; echo "bench dsv3 rc=$? after ${SECONDS}s"
tail -4 "$OUT/bench_wgmma.err" | cut -c1-1200; tail -1 "$OUT/bench_wgmma_dsv3.err" | cut -c1-800
