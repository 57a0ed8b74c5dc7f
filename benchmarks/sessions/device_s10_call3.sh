#!/usr/bin/env bash
# Session 10, call 3: the quantize kernels' GPU tests (whole file) at the libdevice-flush fix, then the launch-config
# sweep of the guided compact, RNE fake-quant and quantize + record ops by device time (CUDA graph).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 400 python3 -m pytest -q -p no:cacheprovider -n 16 -rf --tb=line tests/kernels/test_quant_triton.py 2>&1 \
    | grep -E "passed|failed|FAILED" | head -30
timeout 150 python3 benchmarks/bench_quant.py --sweep --ops "guided_compact+dequant(fake,fake_quant_rne+ste_mask,quantize_nvfp4_row+record" \
    > "$OUT/quant_sweep.jsonl" 2> "$OUT/quant_sweep.err"
python3 - "$OUT/quant_sweep.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "op" in r:
        print(r["op"][:40], r["config"]["tile"], r["config"]["num_warps"], r.get("time_us"), r.get("frac_copy"))
PY
