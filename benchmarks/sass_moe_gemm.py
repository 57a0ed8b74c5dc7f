"""Cross-compile the W4A16 grouped GEMM (``moe_triton.fp4_gemm_kernel``) for sm_90 (no GPU needed).

For each launch config on one shape: registers and spills (``ptxas -v``), shared memory, programs resident per
multiprocessor, and the SASS of the K loop per weight and by opcode.
The specialization is the one ``grouped_mm`` gets on contiguous tensors (strides 16-divisible, T not).
``python benchmarks/sass_moe_gemm.py [--shape qwen3_fc1] [--configs 128,128,16,4,4 ..]`` prints one JSON row each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from types import SimpleNamespace

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_gemm import SHAPES  # noqa: E402
from sass_kv_attention import disassemble, op_counts, ptxas_usage, resident_programs, signature  # noqa: E402

from megatron_trace.kernels import moe_triton as mt  # noqa: E402

_PTRS = {"x_ptr": "*bf16", "wq_ptr": "*u16", "ws_ptr": "*u8", "g_ptr": "*fp32", "y_ptr": "*bf16", "offs_ptr": "*i32"}


def compile_gemm(shape: str, config: tuple, tpe: int = 1, fn=None, k_slices: int = 1, programs: int = 0):
    """The compiled kernel of ``config`` on ``shape`` (NVFP4, per-tensor amax) with ``tpe`` tokens per expert
    (``k_slices`` > 1: the sliced build, y the fp32 workspace; ``programs`` > 0: the COMPACT grid)."""
    e, k, n = SHAPES[shape]
    w = SimpleNamespace(shape=(e, n, k), fmt="nvfp4", block_size=16, global_amax=SimpleNamespace(dim=lambda: 0))
    scalars, _, meta = mt.launch_spec(e * tpe, w, config, True, k, n, k_slices, programs)
    nw, ns, mr = meta.pop("num_warps"), meta.pop("num_stages"), meta.pop("maxnreg", None)
    fn = fn or mt.fp4_gemm_kernel
    ints = dict(zip(("T", "N", "K", "E", "stride_xt", "stride_we", "stride_wn", "stride_se", "stride_sn",
                     "stride_yt"), scalars), stride_ys=meta.pop("stride_ys", 0), PROGRAMS=meta.pop("PROGRAMS", 1))
    ptrs = dict(_PTRS, y_ptr="*fp32") if k_slices > 1 else _PTRS
    sig, attrs = signature(fn, meta, ptrs.get, lambda name: ints[name] % 16 == 0 and name != "T")
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=meta, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns,
                                                                             "maxnreg": mr}), meta, nw


def k_loop_sass(cubin: bytes) -> list[str]:
    """SASS of the K loop: the shortest backward-branch loop that holds an HGMMA (the token-tile loop around it
    also holds the pipeline's prologue and epilogue)."""
    lines = disassemble(cubin).splitlines()
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if re.match(r"^\.L_x_\d+:$", ln)}
    best: list[str] = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
        if not m or labels.get(m.group(1), i) >= i:
            continue
        body = [re.sub(r"\s*/\*[0-9a-f]+\*/\s*", " ", x).strip() for x in lines[labels[m.group(1)]:i + 1]
                if re.search(r"/\*[0-9a-f]{4,}\*/", x)]
        if any("HGMMA" in x for x in body) and (not best or len(body) < len(best)):
            best = body
    return best


def report(shape: str, config: tuple, k_slices: int = 1, programs: int = 0) -> dict:
    kern, meta, nw = compile_gemm(shape, config, k_slices=k_slices, programs=programs)
    regs, spills = ptxas_usage(kern.asm["ptx"])
    body = k_loop_sass(kern.asm["cubin"])
    smem = kern.metadata.shared
    resident = resident_programs(regs, smem, nw)
    per_trip = meta["BN"] * meta["BK"]  # weights per K step
    return {"shape": shape, "config": list(config), "k_slices": k_slices, "programs": programs, "registers": regs,
            "spill_bytes": spills, "shared_bytes": smem, "resident": resident, "loop_sass": len(body),
            "sass_per_weight": round(len(body) * nw * 32 / per_trip, 3), "top_ops": op_counts(body, 16)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_fc1", choices=sorted(SHAPES))
    p.add_argument("--configs", nargs="*", default=None, help="BN,BK,BT,num_warps,num_stages[,join_k[,max_registers]]")
    p.add_argument("--k-slices", type=int, default=1, help="the sliced build (moe_slices)")
    p.add_argument("--programs", type=int, default=0, help="> 0: the COMPACT grid's build")
    p.add_argument("--dump", action="store_true", help="also print the loop's SASS")
    a = p.parse_args(argv)
    cfgs = [tuple(int(v) for v in c.split(",")) for c in a.configs] if a.configs else [mt.CONFIGS[0][1]]
    for cfg in cfgs:
        row = report(a.shape, cfg, a.k_slices, a.programs)
        print(json.dumps(row), flush=True)
        if a.dump:
            kern, _, _ = compile_gemm(a.shape, cfg, k_slices=a.k_slices, programs=a.programs)
            print("\n".join(k_loop_sass(kern.asm["cubin"])))


if __name__ == "__main__":
    main()
