"""The wgmma FP4 grouped GEMM's sm_90a build, cross-compiled on the CPU with NVRTC (``benchmarks/sass_moe_wgmma.py``):
every format and token tile compiles without spills in one CTA's registers, the MMAs are one HGMMA 64 x tile x 16 per
k16 step with the A operand in registers, each stage's group is left running while the next is prepared (a wait for
all but one), and no memory barrier stalls the loop (the TMA token loads need no proxy fence: session 27, call 2's
cp.async did)."""

from __future__ import annotations

from collections import Counter

import pytest

from .conftest import nvrtc_bench


@pytest.fixture(scope="module")
def sass(bench_module):
    return nvrtc_bench(bench_module, "sass_moe_wgmma")


@pytest.mark.parametrize("mx,bt,stages", [(False, 256, 32), (True, 256, 32), (False, 128, 12), (True, 128, 112)],
                         ids=["nvfp4-256-k2048", "mxfp4-256-k2048", "nvfp4-128-k768", "mxfp4-128-k7168"])
def test_builds_keep_the_pipeline(sass, mx, bt, stages):
    row = sass.report(mx, bt, stages)
    assert row["spill_bytes"] == 0 and row["registers"] <= 255, row
    regs, _, body = sass.build(mx, bt, stages)
    hgmma = [ins for ins in body if ins.startswith("HGMMA")]
    # 4 k16 steps per stage, one m64n{bt}k16 each, unrolled 4 stages deep; a last 256-token tile of at most 128 tokens
    # in its own copy of the loop, m64n128k16 (session 28, call 4: a branch between the wgmmas instead made ptxas join
    # the paths with no-op HGMMAs, and every tile 1.2x slower)
    widths = Counter(ins.split()[0] for ins in hgmma)
    assert widths == Counter({f"HGMMA.64x{bt}x16.F32.BF16": 16, **({"HGMMA.64x128x16.F32.BF16": 16} if bt == 256
                                                                    else {})}), widths
    assert all("gdesc" in ins.split(",")[2] for ins in hgmma)  # (A from registers, B by descriptor)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in row["hgmma_waits"], row
    assert row["membar"] == 0 and row["tma_loads"] >= 1, row
