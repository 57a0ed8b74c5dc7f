"""The expert-GEMM benchmarks' ``--shapes`` and ``--variants``: a name that is no shape (a KeyError at that shape,
once the shapes before it had spent their device time), or a macro the CUDA source does not read (the default build
timed under the variant's name), is refused before any GPU work."""

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


@pytest.mark.parametrize("script", ["bench_moe_mma", "bench_moe_wgmma"])
def test_variant_macro_the_source_does_not_read_is_refused(bench_module, capsys, script):
    """``--variants ,MIN_BLOCK=1`` (a typo) timed the default build under that name."""
    mod = bench_module(script)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--variants", ",MIN_BLOCK=1"])
    assert exc.value.code == 2 and "['MIN_BLOCK=1']: the source reads none of them" in capsys.readouterr().err


def test_sass_build_refuses_a_macro_the_source_does_not_read(bench_module):
    sass = bench_module("sass_moe_mma")
    with pytest.raises(ValueError, match="MIN_BLOCK=1"):  # (before NVRTC is looked for)
        sass.compile_source(False, ("MIN_BLOCK=1",))
