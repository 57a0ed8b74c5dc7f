#!/usr/bin/env bash
# Session 8, first call: GPU tests of the FP4-KV attention (scales read as uint16 pairs: MMA operands at kWidth 2;
# exp2 softmax), a probe of the MXFP4 16-token tiles refused since session 7, then bench_decode_attn.py in device
# time (CUDA graphs) at 8K/32K and Nsight Compute on the fast kernel at batch 8 / 64, 8K ($OUT/src_attn.csv).
source benchmarks/_device_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_kv_attention.py \
    tests/gpu/test_kv_attention_gpu.py 2>&1 | tail -3
python3 - <<'PY'
import torch
from megatron_trace.formats import Quantizer
from megatron_trace.kernels import kv_attention_triton as kt
from megatron_trace.kernels.kv_attention import reference_attention
g = torch.Generator().manual_seed(0)
kt.MXFP4_MIN_BLOCK_T = 16  # probe only: the refusal's threshold
for t_len in (37, 300):
    q = torch.randn(2, 8, 64, generator=g).bfloat16().cuda()
    k, v = (Quantizer("mxfp4").quantize(torch.randn(2, 2, t_len, 64, generator=g).cuda()) for _ in range(2))
    ref = reference_attention(q, k, v, scale=0.125, kv_dtype=torch.float32).float()
    for bt in (16, 32):
        got = kt.decode_attention(q, k, v, scale=0.125, exact=False, block_t=bt).float()
        print("mxfp4 probe T", t_len, "block_t", bt, "rel err", float((got - ref).norm() / ref.norm()))
PY
python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8192,32768 > "$OUT/attn.jsonl" 2> "$OUT/attn.err"
tail -3 "$OUT/attn.err"
python3 - "$OUT/attn.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(json.dumps({k: v for k, v in r.items() if k.endswith("_us") or k in ("batch", "context", "timers", "error",
                      "fused_fast_over_bf16", "fused_fast_frac_copy", "bf16_frac_copy", "fast_rel_err_fp32")}))
PY
NCU=(ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel)
"${NCU[@]}" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    python3 benchmarks/ncu_kernels.py --ops attn > "$OUT/attn_ncu.txt" 2> "$OUT/ncu.err" || tail -3 "$OUT/ncu.err"
grep -E "^  [a-z]|Duration|DRAM Throughput|Registers Per|Achieved Occ|Theoretical Occ" "$OUT/attn_ncu.txt" | cut -c1-120
"${NCU[@]}" --section SourceCounters --page source --print-source sass --csv \
    python3 benchmarks/ncu_kernels.py --ops attn --only "fp4_attn_b64_" > "$OUT/src_attn.csv" 2>> "$OUT/ncu.err"
