"""The CUDA FP4 grouped GEMM's sm_90 build, cross-compiled on the CPU with NVRTC (``benchmarks/sass_moe_mma.py``):
both formats compile, fit two CTAs per multiprocessor without spills (the register budget the kernel's pipeline was
measured with), and run the MMAs and dequantizing multiplies the source lays out."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sass(bench_module):
    pytest.importorskip("triton", reason="the disassembler comes with triton (make test installs it)")
    mod = bench_module("sass_moe_mma")
    if mod.nvrtc_library() is None:
        pytest.skip("needs NVRTC: pip install nvidia-cuda-nvrtc==13.0.* (make test installs it)")
    return mod


@pytest.mark.parametrize("mx", [False, True], ids=["nvfp4", "mxfp4"])
def test_builds_fit_two_ctas_without_spills(sass, mx):
    row = sass.report(mx)
    assert row["spill_bytes"] == 0 and row["registers"] <= 128, row
    assert row["ctas_per_sm_k2048"] == 2, row


@pytest.mark.parametrize("mx", [False, True], ids=["nvfp4", "mxfp4"])
def test_mma_and_dequant_instructions(sass, mx):
    cubin, _ = sass.compile_source(mx)
    body = sass.function_sass(cubin, mx)
    mma = [i for i in body if i.split()[0].startswith("HMMA")]
    # 8 words x 2 m16 tiles x 2 k-steps per step, for 1 or 2 token tiles, in both halves of the double buffer
    assert len(mma) == 32 * (1 + 2) * 2 and {i.split()[0] for i in mma} == {"HMMA.16816.F32.BF16"}
    dequant = [i for i in body if i.split()[0] == "HMUL2.BF16_V2"]
    assert len(dequant) >= 4 * 32 * 4  # a bf16x2 multiply per pair of codes, 32 words per step, 4 instantiations
    assert not [i for i in body if i.split()[0].startswith(("STL", "LDL"))]  # no local memory
