"""The CUDA FP4 grouped GEMM's sm_90 build, cross-compiled on the CPU with NVRTC (``benchmarks/sass_moe_mma.py``):
both formats compile, fit two CTAs per multiprocessor without spills (the register budget the kernel's pipeline was
measured with), and run the MMAs and dequantizing multiplies the source lays out."""

from __future__ import annotations

import pytest

from .conftest import nvrtc_bench


@pytest.fixture(scope="module")
def sass(bench_module):
    return nvrtc_bench(bench_module, "sass_moe_mma")


LAYOUTS = pytest.mark.parametrize("mx,packed", [(False, False), (True, False), (False, True), (True, True)],
                                  ids=["nvfp4", "mxfp4", "nvfp4-packed", "mxfp4-packed"])


def _local_in_loop(body):
    """Local-memory instructions between the first and the last MMA (the step loop)."""
    mma = [i for i, ins in enumerate(body) if ins.split()[0].startswith("HMMA")]
    return [ins for ins in body[mma[0]:mma[-1]] if ins.split()[0].startswith(("STL", "LDL"))]


@LAYOUTS
def test_builds_fit_two_ctas_and_the_packed_loop_touches_no_local_memory(sass, mx, packed):
    """128 registers, two CTAs per multiprocessor, at Qwen3-30B-A3B's FC1 (K / 256 = 8 steps, a constant of the
    build) with the balanced split. The packed layout's step loop (the rollout's) has no spilled register in it;
    with NVRTC 13.0 the NVFP4 build keeps one word in local memory outside the loop, and the plain layout's builds a
    few (session 26: the plain layout is the slower one anyway)."""
    row = sass.report(mx, packed=packed)
    assert row["registers"] <= 128 and row["ctas_per_sm_k2048"] == 2, row
    if packed:
        assert row["spill_bytes"] <= 8, row
        cubin, _ = sass.compile_source(mx, packed=packed)
        assert not _local_in_loop(sass.function_sass(cubin, mx, packed))


@LAYOUTS
def test_mma_and_dequant_instructions(sass, mx, packed):
    cubin, _ = sass.compile_source(mx, packed=packed)
    body = sass.function_sass(cubin, mx, packed)
    mma = [i for i in body if i.split()[0].startswith("HMMA")]
    # 8 words x 2 m16 tiles x 2 k-steps per step, for 1 or 2 token tiles, in both halves of the double buffer
    assert len(mma) == 32 * (1 + 2) * 2 and {i.split()[0] for i in mma} == {"HMMA.16816.F32.BF16"}
    dequant = [i for i in body if i.split()[0] == "HMUL2.BF16_V2"]
    assert len(dequant) >= 4 * 32 * 4  # a bf16x2 multiply per pair of codes, 32 words per step, 4 instantiations
    loads = [i.split()[0] for i in body if i.split()[0].startswith("LDG")]
    if packed:  # per step, 8 code loads of 16 bytes and one scale load of 16 (NVFP4) or 8 (MXFP4) bytes per lane
        wide, narrow = loads.count("LDG.E.NA.128.CONSTANT"), loads.count("LDG.E.NA.64.CONSTANT")
        assert (wide % 8, narrow * 8) == (0, wide) if mx else (wide % 9, narrow) == (0, 0)
        assert not [i for i in loads if "U8" in i or "U16" in i]

