#!/usr/bin/env bash
# Session 30, call 6: the experts combine in one Triton launch (kernels.moe_combine_triton; fp4_moe._combine on
# CUDA). Its GPU tests and the rollout's experts / static-decode / generate tests; bench_moe_combine (the eager
# gather + multiply + sum against the kernel, and which fp32 order gives PyTorch's bits); then the prefill profile
# of session 29 (batch 8, 2048-token prompts; there 89.0 ms BF16, 92.4 FP4 of GPU time, the combine about 12%).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_moe_combine_gpu.py \
    tests/kernels/test_moe_combine.py tests/gpu/test_moe_routing_gpu.py 2>&1 | tail -6
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_rollout_gpu.py \
    tests/gpu/test_kv_attention_gpu.py -k "experts or static or generate or grouped" 2>&1 | tail -6
timeout 90 python3 benchmarks/bench_moe_combine.py > "$OUT/moe_combine.jsonl" 2> "$OUT/moe_combine.err"
echo "combine rc=$?"; tail -2 "$OUT/moe_combine.err"; cat "$OUT/moe_combine.jsonl"
timeout 200 python3 benchmarks/profile_prefill.py --batch 8 --prompt 2048 --tokens 1 --top 30 --variants bf16,fp4 \
    > "$OUT/prefill_b8.jsonl" 2> "$OUT/prefill_b8.log"
echo "prefill rc=$?"; tail -2 "$OUT/prefill_b8.log"
python3 - "$OUT/prefill_b8.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    i = r["idle"]
    print(r["variant"], r["batch"], "wall", r["walls_ms"], "gpu", r["gpu_ms"], "span", i.get("span_ms"), "idle",
          i.get("idle_ms"), r["kinds_ms"])
    print("  top", [t[:3] for t in r["top"][:12]])
PY
