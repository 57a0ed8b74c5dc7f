#!/usr/bin/env bash
# Session 28, call 1: the wgmma GEMM on a persistent grid (one CTA per multiprocessor looping over its 128-row x
# expert items; a tile's last stages load the next tile's first token stages and weights; the epilogue's tile beside
# the token slots). Its GPU tests (any grid gives the same bits), then Qwen3's FC1 / FC2 at 128 / 192 / 256 tokens
# per expert and DeepSeek-V3's FC1 at 128 / 256, persistent against one CTA per item, and the rollout's experts
# forward at prefill sizes.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs --tb=short tests/gpu/test_moe_wgmma_gpu.py \
    tests/kernels/test_moe_wgmma.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20; tail -1 "$OUT/pytest.txt"
timeout 200 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 128,192,256 \
    --grids persistent,items > "$OUT/bench_qwen3.json" 2> "$OUT/bench_qwen3.err"; echo "bench rc=$? after ${SECONDS}s"
timeout 120 python3 benchmarks/bench_moe_wgmma.py --shapes dsv3_fc1 --tokens 128,256 --grids persistent,items \
    --no-triton > "$OUT/bench_dsv3.json" 2> "$OUT/bench_dsv3.err"; echo "bench dsv3 rc=$? after ${SECONDS}s"
timeout 100 python3 benchmarks/bench_prefill_experts.py --tokens 2048,4096,8192 > "$OUT/bench_prefill.json" \
    2> "$OUT/bench_prefill.err"; echo "bench prefill rc=$? after ${SECONDS}s"
python3 benchmarks/summarize_rows.py wgmma "$OUT/bench_qwen3.json"
python3 benchmarks/summarize_rows.py wgmma "$OUT/bench_dsv3.json"
tail -3 "$OUT/bench_prefill.err" | cut -c1-600; tail -2 "$OUT/bench_qwen3.err" | cut -c1-300
