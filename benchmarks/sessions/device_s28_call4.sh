#!/usr/bin/env bash
# Session 28, call 4: a last 256-token tile of at most 128 tokens runs m64n128k16 on its first half (before: the full
# m64n256k16 on a tile mostly empty). The wgmma GPU tests, Qwen3's FC1 / FC2 at 256 and 320 (= 256 + 64) tokens per
# expert, and the rollout's experts forward at prefill sizes (random routing: about half the experts have a second,
# short tile at 4096 tokens).
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs --tb=short tests/gpu/test_moe_wgmma_gpu.py \
    tests/kernels/test_moe_wgmma.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
timeout 200 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 256,320 --tiles 256 \
    > "$OUT/bench_qwen3.json" 2> "$OUT/bench_qwen3.err"; echo "bench rc=$? after ${SECONDS}s"
timeout 100 python3 benchmarks/bench_prefill_experts.py --tokens 2048,4096,8192 > "$OUT/bench_prefill.json" \
    2> "$OUT/bench_prefill.err"; echo "bench prefill rc=$? after ${SECONDS}s"
python3 benchmarks/summarize_rows.py wgmma "$OUT/bench_qwen3.json"
tail -3 "$OUT/bench_prefill.err" | cut -c1-600
