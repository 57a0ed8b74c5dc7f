"""The W4A16 GEMM's sm_90 build (cross-compiled on the CPU by ``benchmarks/sass_moe_gemm.py``): every ``CONFIGS``
row compiles without spills, and the rows wait for all their MMAs at the end of each K step (without that
wait Triton 3.6 let the next step overwrite the registers of MMAs still in flight: about one launch in twenty was
2-3% wrong on the H200, triton-lang/triton#9433)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton", reason="needs triton (no GPU)")  # (CONFIGS is read when the tests are collected)


@pytest.fixture(scope="module")
def sass(bench_module):
    return bench_module("sass_moe_gemm")


def _rows():
    from megatron_trace.kernels import moe_triton

    return [(limit, cfg) for limit, cfg, _ in moe_triton.CONFIGS]


@pytest.mark.parametrize("limit,config", _rows(), ids=lambda v: str(v))
def test_configs_compile_without_spills_and_settle_their_mmas(sass, limit, config):
    tpe = min(limit, 256)
    kern, _, _ = sass.compile_gemm("qwen3_fc1", config, tpe=tpe)
    regs, spills = sass.ptxas_usage(kern.asm["ptx"])
    assert spills == 0 and regs <= 255
    loop = sass.k_loop_sass(kern.asm["cubin"])
    waits = [re.search(r"gsb0, (0x[0-9a-f]+)", line).group(1) for line in loop if "WARPGROUP.DEPBAR" in line]
    assert waits and set(waits) == {"0x0"}, waits  # every in-flight MMA retired before the loop turns over



@pytest.mark.parametrize("k_slices,programs", [(8, 0), (8, 528), (1, 528)], ids=["sliced", "sliced_compact", "compact"])
def test_sliced_and_compact_builds_keep_the_k_loop(sass, k_slices, programs):
    """The batch-1 builds (``moe_slices``: K slices, the compact grid) of the decode row: no spills, the same MMA
    waits, and a K loop within a few instructions of the full grid's (the item loop around it adds no per-step
    work)."""
    config = sass.mt.CONFIGS[0][1]
    full = sass.k_loop_sass(sass.compile_gemm("qwen3_fc1", config)[0].asm["cubin"])
    kern, _, _ = sass.compile_gemm("qwen3_fc1", config, k_slices=k_slices, programs=programs)
    regs, spills = sass.ptxas_usage(kern.asm["ptx"])
    assert spills == 0 and regs <= 255
    loop = sass.k_loop_sass(kern.asm["cubin"])
    waits = [re.search(r"gsb0, (0x[0-9a-f]+)", line).group(1) for line in loop if "WARPGROUP.DEPBAR" in line]
    assert waits and set(waits) == {"0x0"}, waits
    assert abs(len(loop) - len(full)) <= 16, (len(loop), len(full))
