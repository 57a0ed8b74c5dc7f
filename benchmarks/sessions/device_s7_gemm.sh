#!/usr/bin/env bash
# Session 7: GPU tests of the W4A16 grouped GEMM, then the launch-config sweep (bench_moe_gemm.py --sweep;
# $OUT/gemm_sweep.jsonl) on the Qwen3-30B-A3B and DeepSeek-V3 shapes. Run with the "xperm" K mode's configs in the
# sweep (results/s7/gemm_xperm_not_kept.diff); that mode was not kept (BENCHMARKS.md, session 7).
source benchmarks/_device_env.sh
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py -x 2>&1 | tail -3
python3 benchmarks/bench_moe_gemm.py --sweep --shapes "${SHAPES:-qwen3_fc1,qwen3_fc2,dsv3_fc1}" \
    --sweep-tokens "${TOKENS:-1,4,16,64,256}" > "$OUT/gemm_sweep.jsonl" 2> "$OUT/gemm_sweep.err"
rc=$?
tail -3 "$OUT/gemm_sweep.err"
python3 - "$OUT/gemm_sweep.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "time_us" in r:
        print(r["shape"], r["tok_per_expert"], r["config"], r["time_us"], "bf16", r["bf16_us"], "x", r["speedup"],
              "frac", r["fp4_weight_frac_copy"])
    elif "error" in r:
        print("ERR", r["shape"], r["tok_per_expert"], r["config"], r["error"][:100])
PY
exit $rc
