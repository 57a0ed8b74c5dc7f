#!/usr/bin/env bash
# Proposed for the next session with a device (session 41 had none: "no new device machine is lent"). Run from the
# repo root on the device box, carrying .whl: `bash benchmarks/sessions/device_next.sh <call>`; results under $OUT.
#   nccl  (nvidia-h100-x4 / nvidia-h200-x4 if lent, else -x2: the three-rank scenarios then skip): GuidanceSync over
#         NCCL, one GPU per rank (tests/gpu/test_sync_nccl.py: transfers bit-exact, rejections, the abort protocol
#         of session 40, a missing sender, a dead trainer rank), then the two-GPU tests.
#   suite (one GPU): every GPU test at the current code (benchmarks/device_tests.sh; session 39's 1674 passed are the
#         latest whole run).
#   step  (nvidia-h200): the training-step series of session 40 (H100) on an H200, to set beside session 34's.
source benchmarks/_device_env.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
nccl() {
    timeout 560 python3 -m pytest -v -p no:cacheprovider -rfEs --tb=short tests/gpu/test_sync_nccl.py \
        tests/gpu/test_two_gpu.py > "$OUT/pytest_nccl.txt" 2>&1
    echo "pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_nccl.txt" | head; tail -1 "$OUT/pytest_nccl.txt"
}
suite() { bash benchmarks/device_tests.sh; }
step() { source benchmarks/sessions/device_s40.sh; WARM=1 BUDGET=560 qat_runs 1 2 3 4 5 6 7 8; }
"${1:?name a call: nccl, suite or step}"
