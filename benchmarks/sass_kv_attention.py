"""Cross-compile the FP4-KV decode attention kernels for sm_90 (no GPU needed): registers, spills, SASS count.

For each launch config: ``ptxas -v`` (Triton's bundled ptxas) on the kernel's PTX gives registers per thread
and spill bytes; ``nvdisasm`` on the cubin gives the SASS of the tile loop (the instructions between the
loop's label and its backward branch), reported per cached K/V element (``2 * BT * head_dim`` per trip);
``resident``: programs per multiprocessor that registers and shared memory allow (``FAST_RESIDENT``).
The specialization is the one a launch on an ``FP4KVCache`` gets (16-divisible strides except a scale row
shorter than 16 bytes, per-row amax stride 1).
``python benchmarks/sass_kv_attention.py [--d 128] [--fmt nvfp4] [--configs 64,4,2 32,4,2]`` prints one JSON row
per config.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from megatron_trace.kernels import kv_attention_plan
from megatron_trace.kernels import kv_attention_triton as kt

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_PTRS = {"q_ptr": "*bf16", "kc_ptr": "*u16", "ks_ptr": "*u8", "kg_ptr": "*fp32", "vc_ptr": "*u16", "vs_ptr": "*u8",
         "vg_ptr": "*fp32", "len_ptr": "*i32", "first_ptr": "*i32", "mask_ptr": "*u8", "acc_ptr": "*fp32",
         "ml_ptr": "*fp32"}
_FLOATS = ("sm_scale", "k_fac", "v_fac")
SMEM_PER_SM = 233472
"""Shared memory per multiprocessor of the H200 (sm_90: 228 KB configurable, as Nsight Compute reports)."""


_DIV16 = [["tt.divisibility", 16]]


def signature(fn, const: dict, ptr_type, aligned, floats=()) -> tuple[dict, dict]:
    """(signature, attrs) of ``fn`` for ``triton.ASTSource``: ``const`` names are constexprs, ``ptr_type(name)`` a
    pointer type (16-byte aligned) or None, ``floats`` fp32 scalars, the rest i32 (16-divisible where
    ``aligned(name)``), as the JIT specializes them on contiguous tensors."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif (ptr := ptr_type(name)) is not None:
            sig[name] = ptr
            attrs[(i,)] = _DIV16
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if aligned(name):
                attrs[(i,)] = _DIV16
    return sig, attrs


def compile_kernel(fast: bool, d: int, fmt: str, bt: int, warps: int, stages: int, g: int = 4, hkv: int = 4,
                   fn=None, maxnreg: int | None = None, mask: str | None = None, aligned_rows: bool = False):
    """The compiled kernel (``triton.compile`` for sm_90a) of one config; constexprs as ``decode_attention``."""
    fn = fn or (kt.fp4kv_decode_attn_fast_kernel if fast else kt.fp4kv_decode_attn_kernel)
    bs = 16 if fmt == "nvfp4" else 32
    const = dict(HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), FMT=0 if fmt == "nvfp4" else 1, B=bs,
                 BT=bt, HAS_LEN=mask == "interval", HAS_FIRST=mask == "interval", LOAD_R=aligned_rows,
                 HAS_MASK=mask in ("words", "bytes"), MASK_WORDS=mask == "words",
                 F32_DOT=False, TILES=0)
    sw = 4 if (d // bs) % 4 == 0 else 2 if (d // bs) % 2 == 0 else 1  # an FP4KVCache's (``plan.scale_word``)
    fast_const = dict(D=d, DG=kt._group_cols(d), DEQ_ASM=True, SW=sw)
    const.update(fast_const if fast else dict(NB=d // bs, FAST_DIV=True))
    if fmt == "nvfp4":
        const.update(skg_t=1, svg_t=1)  # per-row amax [B, H, T, 1]: stride 1, specialized by the JIT
    sig, attrs = signature(fn, const, _PTRS.get, lambda name: name not in ("T", "chunk", "n_tiles") and not (
        name in ("sks_t", "svs_t") and (d // bs) % 16), _FLOATS)  # (a scale row under 16 bytes is not 16-divisible)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg}
    if not fast:
        opts["enable_fp_fusion"] = False
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def ptxas_usage(ptx: str, maxnreg: int | None = None) -> tuple[int, int]:
    """(registers per thread, spill stores + loads in bytes) of ``ptx`` from ``ptxas -v --gpu-name sm_90a``."""
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "k.ptx"
        p.write_text(ptx)
        cap = ["--maxrregcount", str(maxnreg)] if maxnreg else []
        res = subprocess.run([str(BIN / "ptxas"), "-v", *cap, "--gpu-name", "sm_90a", str(p), "-o",
                              str(Path(tmp) / "k.o")], capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr))
    return regs, spills


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` of a cubin (Triton's bundled nvdisasm)."""
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "k.cubin"
        p.write_bytes(cubin)
        return subprocess.run([str(BIN / "nvdisasm"), "-c", str(p)], capture_output=True, text=True, check=True).stdout


def op_counts(body: list[str], top: int) -> dict[str, int]:
    """The ``top`` most frequent opcodes (predicates and modifiers dropped) of SASS lines ``body``."""
    ops: dict[str, int] = {}
    for ins in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return dict(sorted(ops.items(), key=lambda kv: -kv[1])[:top])


def resident_programs(regs: int, smem: int, warps: int) -> int:
    """Programs per sm_90 multiprocessor that registers (allocated per warp in units of 256) and shared memory
    (plus the driver's 1 KB per program) allow."""
    regs_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (regs_warp * warps), SMEM_PER_SM // (smem + 1024), 64 // warps, 32)


def loop_sass(cubin: bytes) -> list[str]:
    """SASS instructions of the longest backward-branch loop of ``cubin`` (the tile loop)."""
    text = disassemble(cubin)
    lines = [ln for ln in text.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16) for ln in lines]
    best: list[str] = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?.*?(0x[0-9a-f]+|\.L_x_\d+)", ln)
        if not m or "BRA" not in ln:
            continue
        target = m.group(1)
        if target.startswith(".L_x_"):
            lab = [j for j, x in enumerate(text.splitlines()) if x.startswith(target + ":")]
            if not lab:
                continue
            after = text.splitlines()[lab[0] + 1:]
            first = next((x for x in after if re.search(r"/\*[0-9a-f]{4,}\*/", x)), None)
            if first is None:
                continue
            tgt = int(re.search(r"/\*([0-9a-f]{4,})\*/", first).group(1), 16)
        else:
            tgt = int(target, 16)
        if tgt < addr[i]:
            body = [x for x, a in zip(lines, addr) if tgt <= a <= addr[i]]
            best = body if len(body) > len(best) else best
    return [re.sub(r"\s*/\*[0-9a-f]+\*/\s*", " ", x).strip() for x in best]


def report(fast: bool, d: int, fmt: str, bt: int, warps: int, stages: int, maxnreg: int | None = None,
           mask: str | None = None, aligned_rows: bool = False) -> dict:
    k = compile_kernel(fast, d, fmt, bt, warps, stages, maxnreg=maxnreg, mask=mask, aligned_rows=aligned_rows)
    regs, spills = ptxas_usage(k.asm["ptx"], maxnreg)
    body = loop_sass(k.asm["cubin"])
    top = op_counts(body, 12)
    smem = k.metadata.shared
    resident = resident_programs(regs, smem, warps)
    return {"kernel": "fast" if fast else "exact", "fmt": fmt, "head_dim": d, "block_t": bt, "num_warps": warps,
            "num_stages": stages, "max_registers": maxnreg, "mask": mask, "aligned_rows": aligned_rows,
            "registers": regs, "spill_bytes": spills,
            "shared_bytes": smem, "resident": resident, "loop_sass": len(body),
            "sass_per_element": round(len(body) * warps * 32 / (2 * bt * d), 2), "top_ops": top}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--fmt", default="nvfp4", choices=["nvfp4", "mxfp4"])
    p.add_argument("--configs", nargs="*", default=None,
                   help="BT,num_warps,num_stages[,max_registers] of the fast kernel (default: its default for --d)")
    p.add_argument("--exact", action="store_true", help="also the exact kernel at its defaults")
    p.add_argument("--mask", default=None, choices=["words", "bytes", "interval"],
                   help="build with a kv_mask (as words or bytes) or per-row (first, end) intervals")
    p.add_argument("--aligned-rows", action="store_true",
                   help="loads bounded by a 16-divisible row count R (readable_rows), the attention by T")
    args = p.parse_args(argv)
    for cfg in args.configs or [",".join(str(x or 0) for x in kv_attention_plan.fast_config(args.d))]:
        bt, nw, ns, *mr = (int(x) for x in cfg.split(","))
        print(json.dumps(report(True, args.d, args.fmt, bt, nw, ns, mr[0] if mr and mr[0] else None, args.mask,
                                args.aligned_rows)), flush=True)
    if args.exact:
        print(json.dumps(report(False, args.d, args.fmt, kt.BLOCK_T, kt.NUM_WARPS, 3, mask=args.mask,
                                aligned_rows=args.aligned_rows)), flush=True)


if __name__ == "__main__":
    main()
