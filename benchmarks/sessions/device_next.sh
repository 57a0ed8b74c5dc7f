#!/usr/bin/env bash
# Proposed for the next session with a device (sessions 41-42 had one-GPU H100s only; session 43 ran step and
# suite on an H200). Run from the repo root on the
# device box, carrying .whl: `bash benchmarks/sessions/device_next.sh <call>`; results under $OUT. The wheels:
# benchmarks/sessions/device_s43.sh lists them (transformers 5.24.0: 5.25 needs a newer huggingface-hub than the box's).
#   nccl  (nvidia-h100-x4 / nvidia-h200-x4 if lent, else -x2: the three-rank scenarios then skip): GuidanceSync over
#         NCCL, one GPU per rank (tests/gpu/test_sync_nccl.py: transfers bit-exact, rejections, the abort protocol
#         of session 40, a missing sender, a dead trainer rank), then the two-GPU tests.
#   suite (one GPU): every GPU test at the current code (benchmarks/device_tests.sh; session 41's 1743 passed at
#         10c8404 are the latest whole run; session 42's product changes since are host-side).
#   step  (nvidia-h200): the training-step series of sessions 40 and 42 (H100) on an H200, beside session 34's.
#   Megatron-LM (one GPU; carry .whl and build/megatron-lm, made as benchmarks/sessions/megatron_lm_runs.sh says):
#         `bash benchmarks/sessions/megatron_lm_runs.sh bf16 fp4 reuse save_bf16 load_fp4` (session 42's runs).
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
