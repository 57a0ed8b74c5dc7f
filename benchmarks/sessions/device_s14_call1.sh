#!/usr/bin/env bash
# Next session, first call (written in session 13, not run): the CUDA-graph decode (rollout.static_decode,
# HFRolloutBackend(static_decode="graph")): its GPU tests, the raw decode loop eager vs replayed, and generate's
# tokens/s and capture share with graphs against the default loop; then the W4A16 GEMM under random routing with
# the BN 64 configs.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 -rf --tb=short tests/gpu/test_rollout_gpu.py -k static \
    2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
timeout 120 python3 benchmarks/bench_static_decode.py --modes bf16,fp4 --batches 8,64 --prompt 1024 --steps 64 \
    > "$OUT/static_decode.jsonl" 2> "$OUT/static_decode.err"; tail -3 "$OUT/static_decode.err"; cat "$OUT/static_decode.jsonl"
for sd in graph off; do
    timeout 110 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8 --lengths 1024 --no-graph \
        --generate-batches 8,64 --gen-reps 3 --static-decode $sd --out "$OUT/generate_$sd.jsonl" > /dev/null \
        2> "$OUT/generate_$sd.err"
    echo "== static_decode $sd"; tail -2 "$OUT/generate_$sd.err"; grep decode_generate "$OUT/generate_$sd.jsonl" | cut -c1-300
done
timeout 100 python3 benchmarks/bench_moe_skew.py --shapes e2e_fc1,qwen3_fc1 > "$OUT/moe_skew.jsonl" 2> "$OUT/moe_skew.err"
tail -1 "$OUT/moe_skew.err"; cut -c1-400 "$OUT/moe_skew.jsonl"
