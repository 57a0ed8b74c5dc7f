#!/usr/bin/env bash
# Session 26, call 4: the balanced split (moe_mma.BALANCED: the row blocks x passes of all experts dealt to one wave
# of CTAs). GPU tests of the CUDA GEMM; the same-tokens-per-expert bench (against calls 2-3: does the split's code
# cost anything?); the GEMM under random top-8 routing against Triton and bf16, NVFP4 and MXFP4.
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_mma_gpu.py tests/kernels/test_moe_mma.py \
    > "$OUT/pytest_moe_mma.txt" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/pytest_moe_mma.txt"
timeout 150 python3 benchmarks/bench_moe_mma.py --fmt nvfp4 --tokens 1,4,16 --variants "" --packed \
    > "$OUT/moe_mma_uniform.json" 2> "$OUT/moe_mma_uniform_err.txt"; echo "bench uniform rc=$?"
python3 - "$OUT/moe_mma_uniform.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    v = " ".join(f"{k}={x['us']}us/{x['weight_frac_copy']}/{x['speedup_vs_bf16']}x" for k, x in r.items()
                 if isinstance(x, dict))
    print(r["shape"], r["fmt"], r["tok_per_expert"], "bf16", r["bf16_us"], "triton", r["triton_us"], v)
PY
for fmt in nvfp4 mxfp4; do
  timeout 200 python3 benchmarks/bench_moe_mma_routing.py --fmt $fmt > "$OUT/moe_mma_routing_$fmt.jsonl" \
      2> "$OUT/moe_mma_routing_${fmt}_err.txt"; echo "routing $fmt rc=$?"
  python3 - "$OUT/moe_mma_routing_$fmt.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["shape"], r["fmt"], "b", r["batch"], "act", r["active_experts"], "max", r["max_tokens"], "bf16",
          r["bf16_us"], "triton", r["triton_us"], "mma", r["mma_us"], "packed", r["mma_packed_us"], "grid",
          r["mma_packed_grid_us"], "p/tri", r["packed_vs_triton"], "best/bf16", r["best_mma_vs_bf16"],
          "err", r["mma_packed_rel_err"])
PY
done
