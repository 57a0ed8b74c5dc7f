"""Run each Triton FP4 kernel of ``bench_quant.py`` / ``bench_moe_gemm.py`` once, for Nsight Compute.

Everything is compiled and warmed up first; only the region between ``cudaProfilerStart`` and ``Stop`` runs
the kernels to profile, once each, with an NVTX range named after the op. Usage (``bash
benchmarks/sessions/device_s7_ncu.sh`` writes the report):
    ncu --profile-from-start off --nvtx --print-nvtx-rename kernel ... python3 benchmarks/ncu_kernels.py
    python3 benchmarks/ncu_kernels.py --ops quant        # or gemm, mma, attn, all (default: all but mma)
    python3 benchmarks/ncu_kernels.py --only 'guided|fc1_t16'   # the ops whose name matches
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import dequant_triton, fused, moe_triton

GEMM_SHAPES = {"qwen3_fc1": (128, 2048, 1536), "qwen3_fc2": (128, 768, 2048)}


def quant_ops(rows: int, k: int) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q_row, q_mx = Quantizer("nvfp4", per_row=True), Quantizer("mxfp4", scale_rule="ceil")
    q_ste = Quantizer("nvfp4", per_row=True, ste_clip=True)
    t_row, rec, _ = fused.quantize(x, q_row, record=True)
    t_mx = fused.quantize(x, q_mx)[0]
    return {
        "copy": lambda: x.clone(),
        "quantize_nvfp4_row+record": lambda: fused.quantize(x, q_row, record=True, check_finite=False),
        "quantize_mxfp4_ceil": lambda: fused.quantize(x, q_mx, check_finite=False),
        "guided_compact+dequant": lambda: fused.guided(x, rec, write_codes=False, deq_dtype=x.dtype,
                                                       check_finite=False),
        "fake_quant_rne+ste_mask": lambda: fused.quantize(x, q_ste, write_codes=False, deq_dtype=x.dtype,
                                                          want_mask=True, check_finite=False),
        "dequantize_nvfp4->bf16": lambda: dequant_triton.dequantize(t_row, torch.bfloat16),
        "dequantize_mxfp4->bf16": lambda: dequant_triton.dequantize(t_mx, torch.bfloat16),
    }


def gemm_ops(tokens=(1, 16)) -> dict:
    ops = {}
    for name, (e, k, n) in GEMM_SHAPES.items():
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = fused.quantize(w, Quantizer("nvfp4"), check_finite=False)[0]
        for tpe in tokens:
            x = torch.randn(tpe * e, k, device="cuda", dtype=torch.bfloat16)
            offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * tpe
            ops[f"fp4_gemm_{name}_t{tpe}"] = (lambda x=x, wq=wq, offs=offs: moe_triton.grouped_mm(x, wq, offs))
            wt = w.transpose(-2, -1)
            ops[f"bf16_grouped_{name}_t{tpe}"] = (lambda x=x, wt=wt, offs=offs: torch._grouped_mm(x, wt, offs=offs))
    return ops


def mma_ops(tokens=(1, 16), variants=("", "SKIP_DEQUANT=1")) -> dict:
    """The CUDA GEMM (``moe_mma``) at Qwen3's FC1, NVFP4 and MXFP4, in its build variants (``moe_mma.DEFINES``), on
    the plain and the packed (``moe_mma.pack``, names ``..._packed``) layout."""
    from megatron_trace.kernels import moe_mma

    def run(x, wq, offs, defines):
        moe_mma.DEFINES = defines
        try:
            return moe_mma.grouped_mm(x, wq, offs)
        finally:
            moe_mma.DEFINES = ()

    e, k, n = GEMM_SHAPES["qwen3_fc1"]
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ops = {}
    for fmt in ("nvfp4", "mxfp4"):
        wq = fused.quantize(w, Quantizer(fmt), check_finite=False)[0]
        for tpe in tokens:
            x = torch.randn(tpe * e, k, device="cuda", dtype=torch.bfloat16)
            offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * tpe
            for var, (layout, wl) in [(v, lw) for v in variants for lw in (("", wq), ("_packed", moe_mma.pack(wq)))]:
                defines = tuple(d for d in var.split("+") if d)
                name = f"mma_{fmt}_fc1_t{tpe}{layout}" + (f"_{var}" if var else "")
                ops[name] = lambda x=x, wl=wl, offs=offs, d=defines: run(x, wl, offs, d)
    return ops


def attn_ops(points=((8, 8192), (64, 8192)), hq=16, hkv=4, d=128) -> dict:
    import torch.nn.functional as F

    from megatron_trace.config import TraceConfig
    from megatron_trace.kernels import quantize
    from megatron_trace.kernels.kv_attention import fp4kv_decode_attention

    quant = TraceConfig().activation_quantizer()
    ops = {}
    for b, length in points:
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kq, vq = quantize(k, quant, check_finite=False), quantize(v, quant, check_finite=False)
        ops[f"fp4_attn_b{b}_L{length}"] = lambda q=q, kq=kq, vq=vq: fp4kv_decode_attention(q, kq, vq, exact=False)
        ops[f"sdpa_bf16_b{b}_L{length}"] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, enable_gqa=True)
    return ops


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="all", choices=("all", "quant", "gemm", "attn", "mma"))
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--only", default="", help="regex: profile only the ops whose name matches")
    a = p.parse_args(argv)
    ops = {}
    if a.ops in ("all", "quant"):
        ops.update(quant_ops(a.rows, a.k))
    if a.ops in ("all", "gemm"):
        ops.update(gemm_ops())
    if a.ops in ("all", "attn"):
        ops.update(attn_ops())
    if a.ops == "mma":
        ops.update(mma_ops())
    if a.only:
        ops = {n: fn for n, fn in ops.items() if re.search(a.only, n)}
    for fn in ops.values():  # compile and warm up outside the profiled region
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in ops.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(json.dumps({"profiled": list(ops)}))


if __name__ == "__main__":
    main()
