#!/usr/bin/env bash
# Session 31, call 1: the host time of the eager steps by module (profile_step_host.py), BF16 against FP4 at batch 8
# and 32 (512-token prompts, 8 new tokens, static_decode eager), with layer 0's pieces per call at batch 8; and
# the Triton launch paths (probe_launch_path.py) on this machine.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
for b in 8 32; do
  extra=""; [ "$b" = 8 ] && extra="--pieces"
  timeout 200 python3 benchmarks/profile_step_host.py --batch $b --prompt 512 --tokens 8 $extra \
      > "$OUT/step_host_b$b.jsonl" 2> "$OUT/step_host_b$b.err"
  echo "b$b rc=$?"; tail -2 "$OUT/step_host_b$b.err"
done
timeout 60 python3 benchmarks/probe_launch_path.py --calls 3000 > "$OUT/launch.json" 2> "$OUT/launch.err"
echo "launch rc=$?"
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/step_host_b*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if r["bench"] == "step_host":
            print(r["mode"], r["batch"], "gen", r["generate_ms"], "prefill", r["prefill_host_ms"], "decode",
                  r["decode_step_host_ms"])
            print("   decode own", r["decode_median_step_own_ms"])
            print("   prefill own", r["prefill_own_ms"])
        else:
            print("pieces", r["mode"], r["host_us_per_call"])
print(open(sys.argv[1] + "/launch.json").read())
PY
