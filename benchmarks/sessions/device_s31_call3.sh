#!/usr/bin/env bash
# Session 31, call 3: A/B on one machine of this session's host-time changes (fused.RowWriter for the static KV
# decode write, kernels.cuda_launch for the CUDA GEMMs) against HEAD 2f30281 (its megatron_trace carried in
# build/ab_base): profile_step_host.py at batch 8 and 32 (512-token prompts, 8 new tokens, eager fixed-buffer
# steps), base / new / base / new; then the GPU tests of the changed code.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
NEW="$PYTHONPATH"
BASE="/tmp/site:$PWD/build/ab_base:$PWD/benchmarks"
for rep in 1 2; do
  for arm in base new; do
    if [ "$arm" = base ]; then export PYTHONPATH="$BASE"; else export PYTHONPATH="$NEW"; fi
    for b in 8 32; do
      extra=""; [ "$b" = 8 ] && extra="--pieces --calls 300"
      timeout 150 python3 benchmarks/profile_step_host.py --batch $b --prompt 512 --tokens 8 $extra \
          > "$OUT/step_host_${arm}_b${b}_r$rep.jsonl" 2> "$OUT/step_host_${arm}_b${b}_r$rep.err"
      echo "$arm b$b r$rep rc=$?"
    done
  done
done
export PYTHONPATH="$NEW"
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/step_host_*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        tag = f.rsplit("/", 1)[1][len("step_host_"):-6]
        if r["bench"] == "step_host":
            d = sorted(r["decode_step_host_ms"][1:])
            print(tag, r["mode"], "gen", r["generate_ms"], "prefill", r["prefill_host_ms"], "decode median",
                  d[len(d) // 2], "experts", r["decode_median_step_own_ms"].get("Qwen3MoeExperts"),
                  "attn", r["decode_median_step_own_ms"].get("Qwen3MoeAttention"))
        else:
            print(tag, "pieces", r["mode"], r["host_us_per_call"])
PY
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_cuda_launch_gpu.py \
    tests/gpu/test_moe_mma_gpu.py tests/gpu/test_moe_wgmma_gpu.py tests/gpu/test_kv_write_gpu.py \
    tests/kernels/test_kv_write.py tests/gpu/test_rollout_gpu.py 2>&1 | tail -6
