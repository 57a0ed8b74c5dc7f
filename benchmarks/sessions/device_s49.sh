#!/usr/bin/env bash
# Session 49's device calls (carrying .whl), from the repo root on the device box:
#   bash benchmarks/sessions/device_s49.sh <call> [args]; results under $OUT, copied to benchmarks/results/s49/.
#   growth   the decode attention kernels' split count taken from the grid instead of a constexpr: their GPU tests
#            (and the rollout's), then Triton compiles inside eager generates whose cache grows (bench_eager_compiles.py,
#            FP4, batch 8, 128-token prompts, 1024 new tokens, 2 rounds, a fresh Triton cache) at this tree and at
#            8ac1d6c (before the change; the same benchmark script copied in), then the attention kernels' device
#            time at both (bench_decode_attn.py, batch 8 / 64 at 8K). Ran at 9ce6ee3 (the script was renamed
#            bench_rollout_compiles.py after it, with the same eager default)
#   static   the same compiles with static decode (generate's default on CUDA: a buffer of the longest prompt plus
#            the new tokens, CUDA graphs) over 8 prompt widths, each twice (FP4, batch 8, 512 new tokens), at this
#            tree and at 8ac1d6c. Ran at 34410b2
# Call 3 ran every GPU test at 34410b2 on call 2's machine: TEST_TIMEOUT=480 bash benchmarks/device_tests.sh
source benchmarks/_device_env.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
OLD=8ac1d6c
old_tree() {  # the tree before the change at /tmp/old, with this tree's benchmark scripts
    rm -rf /tmp/old && mkdir -p /tmp/old && git archive "$OLD" | tar -x -C /tmp/old && \
        cp benchmarks/bench_rollout_compiles.py /tmp/old/benchmarks/
}
growth() {
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu/test_kv_attention_gpu.py \
        tests/kernels/test_kv_attention.py tests/kernels/test_kv_attention_dense.py tests/gpu/test_rollout_gpu.py \
        > "$OUT/pytest.txt" 2>&1
    echo "pytest rc=$? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head; tail -1 "$OUT/pytest.txt"
    old_tree || echo "no old tree"
    for tree in new old; do
        dir=$PWD; [ $tree = old ] && dir=/tmp/old
        (cd "$dir" && PYTHONPATH="/tmp/site:$dir:$dir/benchmarks" timeout 150 python3 benchmarks/bench_rollout_compiles.py \
            --modes fp4 --batch 8 --prompt 128 --tokens 1024 --rounds 2) > "$OUT/compiles_$tree.jsonl" 2> "$OUT/compiles_$tree.err"
        echo "compiles $tree rc=$? at ${SECONDS}s"; tail -2 "$OUT/compiles_$tree.err"; cut -c1-500 "$OUT/compiles_$tree.jsonl"
    done
    for tree in new old; do
        dir=$PWD; [ $tree = old ] && dir=/tmp/old
        (cd "$dir" && PYTHONPATH="/tmp/site:$dir:$dir/benchmarks" timeout 60 python3 benchmarks/bench_decode_attn.py \
            --batches 8,64 --lengths 8192) > "$OUT/attn_$tree.jsonl" 2> "$OUT/attn_$tree.err"
        echo "attn $tree rc=$? at ${SECONDS}s"; tail -2 "$OUT/attn_$tree.err"
        python3 -c "import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print({k: r[k] for k in r if k in ('batch','context','bf16_us','fused_fast_us','fused_us','fused_fast_frac_copy')})" "$OUT/attn_$tree.jsonl"
    done
    tar -czf "$OUT/growth.tgz" -C "$OUT" --remove-files pytest.txt compiles_new.err compiles_old.err attn_new.err attn_old.err
}
static() {
    old_tree || echo "no old tree"
    for tree in new old; do
        dir=$PWD; [ $tree = old ] && dir=/tmp/old
        (cd "$dir" && PYTHONPATH="/tmp/site:$dir:$dir/benchmarks" timeout 170 python3 benchmarks/bench_rollout_compiles.py \
            --modes fp4 --batch 8 --tokens 512 --static-decode auto --widths 96,160,224,288,352,416,480,544 \
            --rounds 16) > "$OUT/static_$tree.jsonl" 2> "$OUT/static_$tree.err"
        echo "static $tree rc=$? at ${SECONDS}s"; tail -2 "$OUT/static_$tree.err"; cut -c1-400 "$OUT/static_$tree.jsonl"
    done
    tar -czf "$OUT/static.tgz" -C "$OUT" --remove-files static_new.err static_old.err
}
"${1:?name a call: growth or static}" "${@:2}"
