#!/usr/bin/env bash
# Session 24, call 1: the CUDA (mma.sync) FP4 grouped GEMM (kernels/moe_mma.cu): compile, its errors against the
# fp32 reference, its GPU tests, then the GEMM benchmark (Triton and CUDA against bf16 _grouped_mm).
# (As run, with the kernel's first layout: each lane streamed a contiguous quarter of K; replaced in call 2.)
source benchmarks/_device_env.sh > /dev/null 2>&1
set -o pipefail
python3 - <<'PY' 2>&1 | tee "$OUT/errors.txt"
import time, torch
from megatron_trace.formats import Quantizer
from megatron_trace.kernels import grouped_mm_reference, moe_mma
t0 = time.time(); moe_mma._kernel(0, False); moe_mma._kernel(0, True); print("compile s", round(time.time() - t0, 2))
for fmt, per_row in (("nvfp4", False), ("nvfp4", True), ("mxfp4", False)):
    for e, n, k, tpe in ((5, 256, 512, [1, 0, 17, 3, 40]), (3, 288, 768, [8, 9, 16]), (128, 1536, 2048, [4] * 128)):
        gen = torch.Generator().manual_seed(0)
        wq = Quantizer(fmt, per_row=per_row).quantize((torch.randn(e, n, k, generator=gen) * 0.02).cuda())
        offs = torch.tensor(tpe).cumsum(0).to(torch.int32).cuda()
        x = torch.randn(sum(tpe) + 3, k, generator=gen).to(torch.bfloat16).cuda()
        ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
        y = moe_mma.grouped_mm(x, wq, offs, out_dtype=torch.float32)
        rel = float((y - ref).norm() / ref.norm()); mx = float((y - ref).abs().max() / ref.abs().max())
        print(fmt, per_row, (e, n, k), "rel", f"{rel:.2e}", "max", f"{mx:.2e}", "tail0", bool((y[-3:] == 0).all()))
PY
timeout 120 python3 -m pytest -q -x tests/gpu/test_moe_mma_gpu.py -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest.txt"
timeout 300 python3 benchmarks/bench_moe_gemm.py --shapes qwen3_fc1,qwen3_fc2 --tokens 1,2,4,8,16,32 --no-sweep \
    > "$OUT/moe_gemm.json" 2> "$OUT/moe_gemm_err.txt"; echo "bench rc=$?"
grep -E "mma|x " "$OUT/moe_gemm_err.txt" | head -60
