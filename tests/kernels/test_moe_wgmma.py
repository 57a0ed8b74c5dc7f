"""The wgmma FP4 grouped GEMM's host side on any machine: its weight layout puts every code and scale where the
kernel's formulas read them, unpack inverts pack, and calls it cannot run are named (the kernel itself:
tests/gpu/test_moe_wgmma_gpu.py; its SASS: tests/benchmarks/test_sass_moe_wgmma.py)."""

import pytest
import torch

from megatron_trace.formats import Quantizer, e2m1
from megatron_trace.kernels import fp4_grouped_mm, grouped_mm_reference, moe_mma, moe_wgmma


@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
def test_pack_puts_each_code_and_scale_where_the_kernel_reads_it(fmt, per_row):
    """Nibble 4 kp + 2 kh + rh of word j of lane 4 g + q in stage s of 16-row group G (all experts' rows) is the code
    of row 16 G + 8 rh + g at k = 64 s + 16 j + 8 kh + 2 q + kp; the stage's scale bytes: NVFP4 (row g + 8 rh, block
    4 s + q) at 8 g + 2 q + rh, MXFP4 (row g + 8 rh, block 2 s + b) at 4 g + 2 b + rh. unpack inverts pack."""
    e, n, k = 2, 128, 512
    w = Quantizer(fmt, per_row=per_row).quantize(torch.randn(e, n, k))
    p = moe_wgmma.pack(w)
    assert p.layout == "wgmma" and p.shape == (e, n, k) and p.global_amax is w.global_amax
    codes = e2m1.unpack(w.codes).reshape(-1, k)  # [E N, K] one code per element
    pc = e2m1.unpack(p.codes.view(torch.uint8))  # nibble order
    stages, mx = k // 64, fmt == "mxfp4"
    i = torch.arange(pc.numel())
    nib, j, lane, s, grp = i % 8, i // 8 % 4, i // 32 % 32, i // 1024 % stages, i // (1024 * stages)
    g, q, kp, kh, rh = lane // 4, lane % 4, nib // 4, nib // 2 % 2, nib % 2
    assert torch.equal(pc, codes[16 * grp + 8 * rh + g, 64 * s + 16 * j + 8 * kh + 2 * q + kp])
    scales, ps = w.block_scales.view(torch.uint8).reshape(-1, k // w.block_size), p.block_scales.view(torch.uint8)
    i = torch.arange(ps.numel())
    per = 32 if mx else 64
    b, s, grp = i % per, i // per % stages, i // (per * stages)
    if mx:
        g, blk, rh = b // 4, 2 * s + b // 2 % 2, b % 2
    else:
        g, blk, rh = b // 8, 4 * s + b // 2 % 4, b % 2
    assert torch.equal(ps, scales[16 * grp + 8 * rh + g, blk])
    u = moe_mma.unpack(p)  # (dispatches on the layout)
    assert torch.equal(u.codes, w.codes) and torch.equal(u.block_scales.view(torch.uint8), w.block_scales.view(
        torch.uint8)) and u.shape == w.shape and u.fmt == w.fmt


def test_pack_names_shapes_it_cannot_take():
    with pytest.raises(ValueError, match="N of 128, got K=512, N=64"):
        moe_wgmma.pack(Quantizer("nvfp4").quantize(torch.randn(2, 64, 512)))
    with pytest.raises(ValueError, match="K a multiple of 256.*K=320"):
        moe_wgmma.pack(Quantizer("nvfp4").quantize(torch.randn(2, 128, 320)))
    with pytest.raises(ValueError, match="NVFP4 or MXFP4 weight of shape \\[E, N, K\\]"):
        moe_wgmma.pack(Quantizer("nvfp4").quantize(torch.randn(128, 512)))


def test_unsupported_calls_are_named_and_the_reference_runs_on_the_cpu():
    w = Quantizer("nvfp4").quantize(torch.randn(4, 128, 512) * 0.02)
    p = moe_wgmma.pack(w)
    x = torch.randn(6, 512).to(torch.bfloat16)
    offs = torch.tensor([1, 3, 3, 6], dtype=torch.int32)
    assert "moe_wgmma.pack" in moe_wgmma.unsupported(x, w)
    assert "cpu" in moe_wgmma.unsupported(x, p)
    assert "'wgmma'" in moe_mma.unsupported(x, p)  # (the decode kernel names the other layout)
    with pytest.raises(ValueError, match="wgmma FP4 grouped GEMM cannot run this call.*cpu"):
        moe_wgmma.grouped_mm(x, p, offs)
    with pytest.raises(ValueError, match="grid=0 must be a positive number of CTAs"):
        moe_wgmma.grouped_mm(x, p, offs, grid=0)
    assert torch.equal(fp4_grouped_mm(x, p, offs), grouped_mm_reference(x, w, offs))


def test_token_tile():
    assert moe_wgmma.token_tile(128 * 128, 128) == 128 and moe_wgmma.token_tile(128 * 128 + 1, 128) == 256
    # 4 token slots beside the epilogue's tile (256 tokens of bf16, or 128 of fp32 a pass), within one CTA's 227 KiB
    assert moe_wgmma.shared_memory(256) == 4 * 256 * 128 + 256 * 272 + 32 + 1024 <= 227 * 1024
    assert moe_wgmma.shared_memory(128) == 4 * 128 * 128 + 128 * 528 + 32 + 1024


def test_source_is_package_data():
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in moe_wgmma.SOURCE.read_text()


def test_preferred_from_64_tokens_per_expert(monkeypatch):
    p = moe_wgmma.pack(Quantizer("nvfp4").quantize(torch.randn(4, 128, 256)))
    assert [moe_wgmma.preferred(r, p) for r in (255, 256)] == [False, True]
    monkeypatch.setattr(moe_wgmma, "AUTO", False)
    assert not moe_wgmma.preferred(512, p)


def test_gemm_wgmma_needs_its_layout():
    w = Quantizer("nvfp4").quantize(torch.randn(2, 128, 256))
    x = torch.randn(3, 256).to(torch.bfloat16)
    offs = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="gemm='wgmma' needs the weights in moe_wgmma.pack's layout"):
        fp4_grouped_mm(x, w, offs, gemm="wgmma")
    assert torch.equal(fp4_grouped_mm(x, w, offs, packed=moe_wgmma.pack(w)), grouped_mm_reference(x, w, offs))
