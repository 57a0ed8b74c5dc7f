"""Cross-compile the quantize and dequantize pair kernels for sm_90 (no GPU needed): registers, spills, SASS.

For the ops of ``bench_quant.py`` (NVFP4 per-row quantize + compact record, guided compact and full + dequant,
RNE fake-quant + STE mask, MXFP4 quantize; NVFP4 dequantize to bf16 (both paths) and fp32, per-row amax; MXFP4 to
bf16) at the launch configs of ``quant_triton.CONFIG`` (``pair_launch.config_name``; "dequant",
"dequant_mxfp4"), with their "max_registers" and "programs_per_sm": ``ptxas -v`` gives registers per thread and
spill bytes, ``nvdisasm`` the SASS of the whole kernel (the fast path and the exact redo's branch together: a static
count, not the instructions one program runs; ``--fast-path``: without the redo's branch, what a tile in range
runs, still a static count); per element = that times 32 * num_warps / (BLOCK_M * K).
``python benchmarks/sass_quant.py [--k 2048] [--fast-path] [--ops guided,mxfp4]`` prints one JSON row per op.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_kv_attention import disassemble, ptxas_usage, signature  # noqa: E402

from megatron_trace.kernels import dequant_triton as dq  # noqa: E402
from megatron_trace.kernels import pair_launch  # noqa: E402
from megatron_trace.kernels import quant_pair_triton as qp  # noqa: E402
from megatron_trace.kernels import quant_triton as qk  # noqa: E402

OPS = {  # op -> (MODE, G_MODE, WRITE_CODES, WRITE_SCALES, WRITE_BITS, WRITE_DEQ, WRITE_MASK[, BY_MAG[, MXFP4]])
    "quantize_nvfp4_row+record": (0, 2, True, True, True, False, False, True),
    "quantize_nvfp4_row+record(index path)": (0, 2, True, True, True, False, False, False),
    "guided_compact+dequant": (2, 3, False, False, False, True, False, True),
    "guided_compact+dequant(index path)": (2, 3, False, False, False, True, False, False),
    "guided_full+dequant": (1, 3, False, False, False, True, False, True),
    "guided_full+dequant(index path)": (1, 3, False, False, False, True, False, False),
    "guided_compact->codes": (2, 3, True, False, False, False, False, True),
    "guided_full->codes": (1, 3, True, False, False, False, False, True),
    "fake_quant_rne+ste_mask": (0, 2, False, False, False, True, True, True),
    "fake_quant_rne+ste_mask(index path)": (0, 2, False, False, False, True, True, False),
    "quantize_mxfp4": (0, 0, True, True, False, False, False, True, True),  # (no global amax, E8M0 scales)
    "quantize_mxfp4(index path)": (0, 0, True, True, False, False, False, False, True),
}
DEQUANT_OPS = {  # op -> (ODT, BY_MAG[, MXFP4]): dequant_pair_kernel, NVFP4 with a per-row amax (G_ROW_GIVEN)
    "dequantize_nvfp4->bf16": (0, True),
    "dequantize_nvfp4->bf16(index path)": (0, False),
    "dequantize_nvfp4->fp32": (2, True),  # the index path (by constants: bf16 only)
    "dequantize_mxfp4->bf16": (0, True, True),  # (no global amax)
}
_PTRS = ("xw_ptr", "x_ptr", "g_ptr", "s_in_ptr", "gc_ptr", "codes_ptr", "scales_ptr", "bits_ptr", "deq_ptr",
         "deq_e_ptr", "mask_ptr", "mask_e_ptr", "err_ptr")
_PTR_TYPES = {"xw_ptr": "*i32", "x_ptr": "*bf16", "g_ptr": "*fp32", "deq_ptr": "*i32", "deq_e_ptr": "*bf16",
              "mask_ptr": "*i16", "err_ptr": "*i32"}


def compile_pair(op: str, k: int, fn=None):
    mode, g_mode, wc, ws, wb, wd, wm, *rest = OPS[op]
    fmt = int(len(rest) > 1 and rest[1])
    block = 32 if fmt else 16
    cfg = qk.CONFIG[pair_launch.config_name(fmt, mode, wd)]
    bm, nbt, num_kt = qk.plan(k, block, cfg["tile"])
    const = dict(NUM_KT=num_kt, XDT=0, FMT=fmt, MODE=mode, G_MODE=g_mode, B=block, BLOCK_M=bm, NBT=nbt, WRITE_CODES=wc,
                 WRITE_SCALES=ws, WRITE_BITS=wb, WRITE_DEQ=wd, WRITE_MASK=wm, CHECK_FINITE=False, FAST_DIV=True,
                 HW_CVT=True, BY_MAG=bool(rest and rest[0]), EVEN_K=True, OUT_ROWS=False,
                 PREFETCH=bool(cfg.get("programs_per_sm")) and num_kt == 1)
    return _compile(fn or qp.pair_kernel, const, _PTR_TYPES, cfg["num_warps"], cfg.get("max_registers")), bm


def compile_dequant(op: str, k: int):
    """``dequant_pair_kernel`` for an op of DEQUANT_OPS (codes [M, K / 2] -> words of two elements)."""
    odt, by_mag, *mx = DEQUANT_OPS[op]
    cfg = qk.CONFIG["dequant_mxfp4" if mx else "dequant"]
    block = 32 if mx else 16
    bm, nbt, num_kt = qk.plan(k, block, cfg["tile"])
    const = dict(NUM_KT=num_kt, ODT=odt, FMT=int(bool(mx)), G_MODE=int(qk.G_NONE if mx else qk.G_ROW_GIVEN), B=block,
                 BLOCK_M=bm, NBT=nbt, FAST_DIV=True, HW_CVT=True, BY_MAG=by_mag)
    types = {"g_ptr": "*fp32", "outw_ptr": "*i64" if odt == 2 else "*i32", "out_ptr": "*fp32" if odt == 2 else "*bf16"}
    cap = cfg.get("max_registers") if odt == 0 else None  # (as ``dequant_triton.dequantize``: bf16 output only)
    return _compile(dq.dequant_pair_kernel, const, types, cfg["num_warps"], cap), bm


def _compile(fn, const, ptr_types, num_warps, max_registers=None):
    """fn compiled for sm_90: constexprs const, pointers of ptr_types (else *u8) and ints 16-divisible but M."""
    const = {n: v for n, v in const.items() if n in fn.arg_names}
    sig, attrs = signature(fn, const, lambda name: ptr_types.get(name, "*u8") if name in _PTRS or name.endswith(
        "_ptr") else None, lambda name: name != "M")
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    opts = {"num_warps": num_warps, "enable_fp_fusion": False}
    if max_registers:
        opts["maxnreg"] = max_registers
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def sass(cubin: bytes) -> list[str]:
    import re

    return [ln for ln in disassemble(cubin).splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]


ALU_OPS = ("LOP3", "LOP", "SEL", "FSEL", "ISETP", "FSETP", "SHF", "FMNMX", "IMNMX", "VIMNMX", "PRMT", "SGXT", "IADD3",
           "LEA", "P2R", "R2P", "PLOP3", "BMSK", "FLO", "POPC", "IABS")
"""Opcodes issued to the ALU pipe (64 lanes per cycle per multiprocessor on sm_90, half the FMA pipes' 128:
FFMA, FMUL, FADD and IMAD run there), after Nsight Compute's pipe descriptions."""


def alu_count(lines: list[str]) -> int:
    """How many of the SASS lines are ALU-pipe instructions (predicated ones too)."""
    n = 0
    for ln in lines:
        words = ln.split("*/", 1)[-1].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        n += op.split(".")[0] in ALU_OPS
    return n


def report(op: str, k: int) -> dict:
    kern, bm = compile_dequant(op, k) if op in DEQUANT_OPS else compile_pair(op, k)
    nw = kern.metadata.num_warps
    regs, spills = ptxas_usage(kern.asm["ptx"])
    lines = sass(kern.asm["cubin"])
    per = 32 * nw / (bm * k)
    return {"op": op, "k": k, "block_m": bm, "num_warps": nw, "registers": regs, "spill_bytes": spills,
            "kernel_sass": len(lines), "kernel_sass_per_element": round(len(lines) * per, 2),
            "kernel_alu_per_element": round(alu_count(lines) * per, 2)}


@triton.jit
def _no_exact_redo(lo_hi_amax, s_b, G_MODE: tl.constexpr, MODE: tl.constexpr, WRITE_DEQ: tl.constexpr,
                   HW: tl.constexpr):
    return 0


def drop_exact_redo() -> None:
    """Build the kernels without the exact redo's branch (``quant_pair_triton._needs_exact`` answers 0): their
    fast path alone, what a tile in range runs. Call it before anything is compiled in this process (the kernels'
    cache keys take the function they call at their first compile)."""
    qp._needs_exact = _no_exact_redo


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--fast-path", action="store_true", help="without the exact redo's branch (drop_exact_redo)")
    p.add_argument("--ops", default="", help="comma-separated substrings of the op names (default: all)")
    a = p.parse_args(argv)
    if a.fast_path:
        drop_exact_redo()
    only = [o for o in a.ops.split(",") if o]
    unmatched = [o for o in only if not any(o in op for op in (*OPS, *DEQUANT_OPS))]
    if unmatched:  # (dropped without a word before: a typo reported nothing and exited 0)
        p.error(f"--ops {a.ops!r}: {unmatched} in no op name; the ops: {', '.join((*OPS, *DEQUANT_OPS))}")
    for op in (*OPS, *DEQUANT_OPS):
        if only and not any(o in op for o in only):
            continue
        print(json.dumps({**report(op, a.k), "fast_path": a.fast_path}), flush=True)


if __name__ == "__main__":
    main()
