"""Cross-compile the wgmma FP4 grouped GEMM (``kernels/moe_wgmma.cu``) for sm_90a with NVRTC on a machine without a
GPU: registers and spills (``ptxas -v``), the SASS by opcode, and the synchronization the pipeline relies on (the
HGMMA groups, how far their waits let them run ahead, memory barriers). ``python benchmarks/sass_moe_wgmma.py`` prints
one JSON row per build (both formats and token tiles at Qwen3-30B-A3B's FC1, K = 2048).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_kv_attention import disassemble, op_counts  # noqa: E402
from sass_moe_mma import compile_named, nvrtc_library, usage  # noqa: E402, F401

from megatron_trace.kernels import moe_mma, moe_wgmma  # noqa: E402


def build(mx: bool, bt: int, stages: int = 32, defines: tuple[str, ...] = ()) -> tuple[int, int, list[str]]:
    """(registers, spill bytes, SASS instructions) of ``fp4_w4a16_wgmma<mx, bt, stages>`` (stages = K / 64)."""
    src = moe_mma.SOURCE.read_text() + "\n" + moe_wgmma.SOURCE.read_text()
    cubin, log = compile_named(src, f"fp4_w4a16_wgmma<{int(mx)}, {bt}, {stages}>", defines, arch="sm_90a")
    regs, spills = usage(log)
    sass = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]+);", disassemble(cubin))]
    return regs, spills, sass


def report(mx: bool, bt: int, stages: int = 32, defines: tuple[str, ...] = ()) -> dict:
    regs, spills, sass = build(mx, bt, stages, defines)
    return {"fmt": "mxfp4" if mx else "nvfp4", "bt": bt, "stages": stages, "defines": list(defines),
            "registers": regs, "spill_bytes": spills, "instructions": len(sass),
            "hgmma": sum(ins.startswith("HGMMA") for ins in sass),
            "hgmma_waits": sorted({ins for ins in sass if ins.startswith("WARPGROUP.DEPBAR")}),
            "membar": sum(ins.startswith("MEMBAR") for ins in sass),
            "tma_loads": sum(ins.startswith("UTMALDG") for ins in sass), "ops": op_counts(sass, 14)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--defines", default="", help="comma-separated NAME=value macros")
    a = p.parse_args(argv)
    defines = tuple(d for d in a.defines.split(",") if d)
    rows = [report(mx, bt, 32, defines) for bt in (128, 256) for mx in (False, True)]
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
