"""The CUDA FP4 grouped GEMM's host side on any machine: where it runs, how it is chosen, and its source ships with
the package (the kernel itself: tests/gpu/test_moe_mma_gpu.py)."""

import pytest
import torch

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fp4_grouped_mm, grouped_mm_reference, moe_mma


def _weight(e=4, n=64, k=512):
    return Quantizer("nvfp4").quantize(torch.randn(e, n, k) * 0.02)


def test_source_is_package_data():
    text = moe_mma.SOURCE.read_text()
    assert "fp4_w4a16_mma" in text and "mma.sync.aligned.m16n8k16" in text
    setup = (moe_mma.SOURCE.parents[2] / "setup.py").read_text()
    assert '"megatron_trace.kernels": ["*.cu"]' in setup  # (installed packages carry the source)


def test_token_tile_fits_two_ctas_per_multiprocessor():
    assert moe_mma.token_tile(2048) == 16 and moe_mma.token_tile(3584) == 16
    assert moe_mma.token_tile(3840) == 8 and moe_mma.token_tile(7168) == 8
    assert moe_mma.token_tile(8192) == 0
    for k in (2048, 7168):
        assert 2 * (moe_mma.token_tile(k) * (2 * k + 32) + 1024) <= 228 * 1024


def test_preferred_only_for_decode_sizes_with_16_token_passes(monkeypatch):
    w = _weight(e=8, k=2048)
    assert not moe_mma.preferred(64, w)  # (AUTO off by default)
    monkeypatch.setattr(moe_mma, "AUTO", True)
    assert [moe_mma.preferred(r, w) for r in (7, 8, 64, 128, 129)] == [False, True, True, True, False]
    assert not moe_mma.preferred(64, _weight(e=8, k=7168))


def test_unsupported_on_the_cpu_names_the_device():
    w = _weight()
    assert "cpu" in moe_mma.unsupported(torch.zeros(2, 512), w)
    with pytest.raises(ValueError, match="cannot run this call.*cpu"):
        moe_mma.grouped_mm(torch.zeros(2, 512), w, torch.tensor([1, 1, 2, 2], dtype=torch.int32))


def test_fp4_grouped_mm_names_a_bad_gemm_and_runs_the_reference_on_the_cpu():
    w = _weight()
    x = torch.randn(4, 512).to(torch.bfloat16)
    offs = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="gemm='cutlass' is not one of"):
        fp4_grouped_mm(x, w, offs, gemm="cutlass")
    assert torch.equal(fp4_grouped_mm(x, w, offs, gemm="mma"), grouped_mm_reference(x, w, offs))
