"""The wgmma FP4-weight grouped GEMM on an H100/H200 (skipped elsewhere): it matches dequantize-then-matmul in fp32
within accumulation-order tolerance for every tile kind (partial token tiles, experts without tokens, several tiles
per expert), zeroes the rows no expert owns, gives the same bits on every launch and for either token tile, and
turns a NaN block scale into NaN rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fp4_grouped_mm, grouped_mm_reference, moe_wgmma

from ._common import grouped_gemm_case

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU (wgmma, built for sm_90a)", allow_module_level=True)

pytestmark = pytest.mark.gpu
TOL = 1e-5
"""Relative error against the fp32 reference with fp32 output (exact weight values; only the order of the fp32 sums
differs)."""


def _case(fmt, per_row, e, n, k, tokens_per_expert, seed=0, tail=3, scale=0.02):
    x, wq, offs = grouped_gemm_case(fmt, per_row, e, n, k, tokens_per_expert, seed, tail, scale)
    return x, wq, moe_wgmma.pack(wq), offs


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("bt", [128, 256])
@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("shape", [
    (5, 128, 256, [1, 0, 130, 300, 64]),   # one stage group; a partial tile, none, 1-2 tiles, several
    (3, 384, 768, [256, 9, 513]),          # 3 CTAs of rows; K = 12 stages
    (4, 256, 2048, [200, 1, 0, 77]),       # Qwen3's K
], ids=["k256", "k768", "k2048"])
def test_matches_reference(fmt, per_row, shape, bt):
    e, n, k, tpe = shape
    x, wq, p, offs = _case(fmt, per_row, e, n, k, tpe)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    y = moe_wgmma.grouped_mm(x, p, offs, out_dtype=torch.float32, bt=bt)
    assert _rel(y, ref) < TOL, _rel(y, ref)
    assert torch.equal(y[-3:], torch.zeros_like(y[-3:]))



@pytest.mark.parametrize("per_row", [False, True], ids=["tensor", "row"])
def test_saturated_encode_scale(per_row):
    """Weights whose global amax lies below 2688 / FLT_MAX: S_enc saturates at FLT_MAX in the kernel's column scale
    2**62 / S_enc as in the reference, whose outputs are nonzero (before the saturation both gave zeros)."""
    x, wq, p, offs = _case("nvfp4", per_row, 3, 256, 512, [1, 0, 17], scale=1e-38)
    assert float(wq.global_amax.max()) < 7.9e-36
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert ref[:18].abs().amax(-1).min() > 0
    y = moe_wgmma.grouped_mm(x, p, offs, out_dtype=torch.float32)
    assert _rel(y * 2.0**100, ref * 2.0**100) < TOL, _rel(y * 2.0**100, ref * 2.0**100)  # (exact scaling: no underflow)

def test_token_tiles_give_the_same_bits_and_bf16_rounds_fp32():
    """A token's sums run over the same k order in either tile, so the bits agree; bf16 out is the fp32 result
    rounded once."""
    x, _, p, offs = _case("nvfp4", True, 4, 256, 1024, [300, 12, 0, 129])
    y128 = moe_wgmma.grouped_mm(x, p, offs, out_dtype=torch.float32, bt=128)
    assert torch.equal(moe_wgmma.grouped_mm(x, p, offs, out_dtype=torch.float32, bt=256), y128)
    assert torch.equal(moe_wgmma.grouped_mm(x, p, offs, bt=128), y128.to(torch.bfloat16))


def test_repeated_launches_give_identical_bits():
    x, _, p, offs = _case("nvfp4", False, 16, 512, 2048, [256, 100, 0, 300] * 4)
    first = moe_wgmma.grouped_mm(x, p, offs)
    for _ in range(20):
        assert torch.equal(moe_wgmma.grouped_mm(x, p, offs), first)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bt", [128, 256])
def test_any_grid_gives_the_same_bits(bt, out_dtype):
    """The persistent grid (one CTA per multiprocessor, each looping over items and loading the next tile's first
    stages under the current one's last): 1, 2, 7 CTAs, the default and one per item give the same bits, with tiles
    of several sizes, experts without tokens and rows no expert owns between them."""
    tpe = [0, 300, 1, 0, 0, 256, 77, 513, 0, 128, 129, 3] * 4
    x, wq, p, offs = _case("nvfp4", True, len(tpe), 512, 768, tpe, tail=5)
    items = len(tpe) * 512 // moe_wgmma.ROWS_PER_CTA
    ref = moe_wgmma.grouped_mm(x, p, offs, out_dtype=out_dtype, bt=bt, grid=items)
    assert _rel(ref, grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)) < (TOL if out_dtype == torch.float32
                                                                                    else 1e-2)
    assert torch.equal(ref[-5:], torch.zeros_like(ref[-5:]))
    for grid in (1, 2, 7, None):
        y = moe_wgmma.grouped_mm(x, p, offs, out_dtype=out_dtype, bt=bt, grid=grid)
        assert torch.equal(y, ref), grid


def test_long_k_and_strided_w4a4_activations():
    """DeepSeek-V3's K = 7168 (112 stages); FP4 activations dequantized to bf16 first; int64 offsets."""
    from megatron_trace.kernels import moe_triton  # (imports triton: after the module's GPU skip)

    x, wq, p, offs = _case("nvfp4", False, 3, 128, 7168, [70, 260, 5])
    ref = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32)
    assert _rel(moe_wgmma.grouped_mm(x, p, offs.long(), out_dtype=torch.float32), ref) < TOL
    x2, wq2, p2, offs2 = _case("nvfp4", False, 2, 128, 1024, [3, 130], tail=0)
    xq = Quantizer("nvfp4").quantize(x2)
    ref = grouped_mm_reference(xq, wq2, offs2, out_dtype=torch.float32)
    assert _rel(moe_wgmma.grouped_mm(xq, p2, offs2, out_dtype=torch.float32), ref) < 1e-2
    assert moe_wgmma.grouped_mm(x2[:0], p2, torch.zeros_like(offs2)).shape == (0, 128)


def test_special_scales_and_codes():
    """Zero blocks, the largest and the subnormal e4m3 scales, every byte of codes: exact products."""
    x, wq, _, offs = _case("nvfp4", False, 2, 128, 512, [130, 11], scale=1.0)
    sc = wq.block_scales.view(torch.uint8).clone()  # [E, N, K/16]
    sc[0, :8] = 0
    sc[0, 8:16] = 0x7E
    sc[1, :8] = torch.arange(1, 9, dtype=torch.uint8, device="cuda")[:, None]
    codes = wq.codes.clone()
    codes[1, 8:24] = torch.arange(256, dtype=torch.uint8, device="cuda").expand(16, 256)
    w = dataclasses.replace(wq, codes=codes, block_scales=sc.view(wq.block_scales.dtype))
    ref = grouped_mm_reference(x, w, offs, out_dtype=torch.float32)
    assert _rel(moe_wgmma.grouped_mm(x, moe_wgmma.pack(w), offs, out_dtype=torch.float32), ref) < TOL


def test_nan_block_scale_gives_nan_rows():
    x, wq, _, offs = _case("nvfp4", False, 2, 128, 512, [3, 140])
    sc = wq.block_scales.view(torch.uint8).clone()
    sc[0, 5, 7] = 0x7F
    sc[1, 40, 31] = 0xFF
    w = dataclasses.replace(wq, block_scales=sc.view(wq.block_scales.dtype))
    ref = grouped_mm_reference(x, w, offs, out_dtype=torch.float32)
    y = moe_wgmma.grouped_mm(x, moe_wgmma.pack(w), offs, out_dtype=torch.float32)
    assert torch.equal(y.isnan(), ref.isnan()) and int(y.isnan().sum()) == 3 + 140
    assert _rel(y.nan_to_num(0.0), ref.nan_to_num(0.0)) < TOL


def test_strided_activations_and_rows_past_the_end():
    """x a column slice of a wider tensor (the tensor map's row stride), the last tile running past T (zeros)."""
    x, wq, p, offs = _case("mxfp4", False, 3, 128, 512, [5, 0, 200], tail=0)
    wide = torch.zeros(x.shape[0], 640, dtype=x.dtype, device="cuda")
    wide[:, 64:576] = x
    xs = wide[:, 64:576]
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(moe_wgmma.grouped_mm(xs, p, offs, out_dtype=torch.float32, bt=256), ref) < TOL


def test_fp4_grouped_mm_runs_it_where_preferred(monkeypatch):
    """packed= in this layout: the wgmma kernel from 64 tokens per expert (the same bits as calling it), the Triton
    kernel below that or with AUTO off; gemm="wgmma" forces it."""
    from megatron_trace.kernels import moe_triton  # (imports triton: after the module's GPU skip)

    x, wq, p, offs = _case("nvfp4", False, 2, 128, 512, [130, 140])
    y = moe_wgmma.grouped_mm(x, p, offs, out_dtype=torch.float32)
    assert torch.equal(fp4_grouped_mm(x, wq, offs, packed=p, out_dtype=torch.float32), y)
    assert torch.equal(fp4_grouped_mm(x, p, offs, out_dtype=torch.float32), y)
    tri = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32)
    assert torch.equal(fp4_grouped_mm(x[:120], wq, offs.clamp(max=120), packed=p, out_dtype=torch.float32),
                       moe_triton.grouped_mm(x[:120], wq, offs.clamp(max=120), out_dtype=torch.float32))
    monkeypatch.setattr(moe_wgmma, "AUTO", False)
    assert torch.equal(fp4_grouped_mm(x, wq, offs, packed=p, out_dtype=torch.float32), tri)
    assert torch.equal(fp4_grouped_mm(x, wq, offs, packed=p, out_dtype=torch.float32, gemm="wgmma"), y)
