"""The expert-GEMM benchmarks' ``--shapes``: a name that is no shape is refused before any GPU work (it raised a
KeyError at that shape, once the shapes before it had spent their device time)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the GEMM benchmarks import the Triton kernels")


@pytest.mark.parametrize("script", ["bench_moe_gemm", "bench_moe_mma", "bench_moe_mma_routing", "bench_moe_skew",
                                    "bench_moe_wgmma"])
def test_unknown_shape_refused_naming_the_valid_ones(bench_module, capsys, script):
    mod = bench_module(script)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--shapes", "qwen3_fc1,qwen3_fc3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "['qwen3_fc3'] not among" in err
    assert all(name in err for name in mod.SHAPES)
