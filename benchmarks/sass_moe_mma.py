"""Cross-compile the CUDA FP4 grouped GEMM (``kernels/moe_mma.cu``) for sm_90 with NVRTC on a machine without a GPU.

NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel (``pip install nvidia-cuda-nvrtc==13.0.*``, about 90 MB; the GPU
box's is the one PyTorch's CUDA wheel loads), the disassembler from Triton's package. Per format (and ``-D`` macro
set), for both layouts and both work splits at K = 2048: registers and spills (``ptxas -v``), CTAs resident per
multiprocessor, and the SASS by opcode. ``python benchmarks/sass_moe_mma.py [--defines SKIP_DEQUANT=1]`` prints one
JSON row per build.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_kv_attention import disassemble, op_counts, resident_programs  # noqa: E402

from megatron_trace.kernels import moe_mma  # noqa: E402


def nvrtc_library() -> Path | None:
    """libnvrtc of the installed ``nvidia-cuda-nvrtc`` wheel (None: not installed)."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        found = [p for pattern in ("cu*/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*")
                 for p in sorted(Path(root).glob(pattern)) if "builtins" not in p.name and ".alt." not in p.name]
        if found:
            return found[0]
    return None


def compile_source(mx: bool, defines: tuple[str, ...] = (), packed: bool = False, balanced: bool = True,
                   steps: int = 8) -> tuple[bytes, str]:
    """(sm_90 cubin, NVRTC log with ptxas's -v lines) of ``fp4_w4a16_mma<mx, packed, balanced, steps>`` (steps =
    K / 256: 8 is Qwen3-30B-A3B's FC1)."""
    name = f"fp4_w4a16_mma<{int(mx)}, {int(packed)}, {int(balanced)}, {steps}>"
    return compile_named(moe_mma.SOURCE.read_text(), name, defines)


def compile_named(source: str, name: str, defines: tuple[str, ...] = (), arch: str = "sm_90") -> tuple[bytes, str]:
    """(cubin, the ptxas -v lines of ``name``) of ``source`` built for ``arch`` with NVRTC."""
    moe_mma.check_defines(defines, source)  # (a macro the source does not read: the default build)
    lib_path = nvrtc_library()
    if lib_path is None:
        raise RuntimeError("NVRTC is not installed: pip install nvidia-cuda-nvrtc==13.0.*")
    ctypes.CDLL(str(lib_path.parent / next(p.name for p in lib_path.parent.glob("libnvrtc-builtins.so.*")
                                           if ".alt." not in p.name)), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(lib_path))
    prog = ctypes.c_void_p()
    src = source.encode()
    name = name.encode()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernel.cu", 0, None, None))
    _check(lib, lib.nvrtcAddNameExpression(prog, name))
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v",
            *(f"-D{d}".encode() for d in defines)]
    res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if res != 0:
        raise RuntimeError(f"{name.decode()} does not compile:\n{log.value.decode()}")
    _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
    cubin = ctypes.create_string_buffer(size.value)
    _check(lib, lib.nvrtcGetCUBIN(prog, cubin))
    lowered = ctypes.c_char_p()
    _check(lib, lib.nvrtcGetLoweredName(prog, name, ctypes.byref(lowered)))
    mangled = lowered.value.decode()
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, _function_log(log.value.decode(), mangled)


def _check(lib, res: int) -> None:
    if res != 0:
        msg = ctypes.c_char_p(lib.nvrtcGetErrorString(res))
        raise RuntimeError(f"NVRTC error {res}: {msg.value}")


def _function_log(log: str, mangled: str) -> str:
    """The ptxas lines of one function (NVRTC compiles both instantiations)."""
    part = log.split(f"Compiling entry function '{mangled}'", 1)[-1]
    return part.split("Compiling entry function", 1)[0]


def usage(log: str) -> tuple[int, int]:
    """(registers, spill bytes stored) from ptxas's -v lines."""
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return regs, spills


def function_sass(cubin: bytes, mx: bool, packed: bool = False, balanced: bool = True, steps: int = 8) -> list[str]:
    """The SASS instructions of ``fp4_w4a16_mma<mx, packed, balanced, steps>``."""
    text = disassemble(cubin)
    mangled = f"_Z13fp4_w4a16_mmaILi{int(mx)}ELi{int(packed)}ELi{int(balanced)}ELi{steps}E"
    sections = re.split(r"\n\s*\.text\.", text)
    body = next(s for s in sections if s.startswith(mangled))
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]+);", body)]


def report(mx: bool, defines: tuple[str, ...] = (), packed: bool = False, balanced: bool = True) -> dict:
    cubin, log = compile_source(mx, defines, packed, balanced)
    regs, spills = usage(log)
    sass = function_sass(cubin, mx, packed, balanced)
    smem = moe_mma.token_tile(2048) * (2 * 2048 + 32)  # (Qwen3-30B-A3B's FC1: K = 2048, 128 experts)
    smem += moe_mma.BALANCED_SMEM if balanced else 0
    return {"fmt": "mxfp4" if mx else "nvfp4", "packed": packed, "balanced": balanced, "defines": list(defines),
            "registers": regs, "spill_bytes": spills,
            "ctas_per_sm_k2048": resident_programs(regs, smem, moe_mma.THREADS // 32), "instructions": len(sass),
            "ops": op_counts(sass, 14)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--defines", default="", help="comma-separated NAME=value macros")
    a = p.parse_args(argv)
    defines = tuple(d for d in a.defines.split(",") if d)
    rows = [report(mx, defines, packed, balanced) for balanced in (False, True) for packed in (False, True)
            for mx in (False, True)]
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
