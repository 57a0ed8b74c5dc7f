#!/usr/bin/env bash
# Where the QAT / guided training step blocks the host: one step per variant under CUDA's sync debug mode
# (by source line), on one H200. Needs the wheels in ./.whl (carry .whl).
#   python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --sync-sites
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
source benchmarks/_install_wheels.sh || exit 1
export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks"
timeout "${QAT_S:-200}" python3 benchmarks/bench_qat_step.py --kernels auto --warmup 2 --reps 5 --sync-sites \
  > "$OUT/qat_syncs.json" 2> "$OUT/qat_syncs.log"
echo "rc=$? after ${SECONDS}s"; tail -n 5 "$OUT/qat_syncs.log"
