#!/usr/bin/env bash
# Session 8, last call (4.9 minutes of device time were left): GPU tests of the NVFP4 dequantize by per-block
# constants (its final version) and of the other quantize kernels, the experts' routing with int16 sort keys
# (grouped path against the reference), then bench_quant.py (each by-magnitude tile against its index path).
source benchmarks/_device_env.sh
timeout 130 python3 -m pytest -q -p no:cacheprovider -n 8 -x tests/kernels/test_quant_triton.py \
    "tests/gpu/test_rollout_gpu.py::test_grouped_path_matches_reference_path" \
    "tests/gpu/test_kv_attention_gpu.py::test_grouped_experts_path_matches_reference" 2>&1 | tail -3
python3 benchmarks/bench_quant.py > "$OUT/quant.json" 2> "$OUT/quant.err"; tail -24 "$OUT/quant.err"
