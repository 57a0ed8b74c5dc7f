#!/usr/bin/env bash
# Session 31, call 2: call 1 found the FP4 pieces' host time per call at batch 8 far above their launches (K+V token
# write 395 us, the experts module 1060 us, its FC1 GEMM 151 us): cProfile of each piece, own us per call.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 200 python3 benchmarks/profile_step_host.py --modes fp4 --batch 8 --prompt 512 --tokens 2 --reps 1 --pieces \
    --calls 300 --cprofile kv_token_write,act_quantize_record,gemm_fc1,decode_attention,experts_module \
    > "$OUT/pieces.jsonl" 2> "$OUT/pieces.err"
echo "rc=$?"; tail -2 "$OUT/pieces.err"
python3 - "$OUT/pieces.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["bench"] != "step_host_pieces":
        continue
    print(r["host_us_per_call"])
    for name, rows in r["cprofile_own_us_per_call"].items():
        print("==", name)
        for row in rows:
            print("   ", row)
PY
