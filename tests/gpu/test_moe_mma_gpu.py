"""The CUDA (mma.sync) FP4-weight grouped GEMM on the GPU (skipped elsewhere): it matches dequantize-then-matmul in
fp32 within accumulation-order tolerance, zeroes the rows no expert owns, gives the same bits on every launch, and
``fp4_grouped_mm`` picks it only where ``moe_mma.unsupported`` is None."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fp4_grouped_mm, grouped_mm_reference, moe_mma

from ._common import grouped_gemm_case

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs an sm_90+ GPU (the kernel multiplies bf16x2)", allow_module_level=True)

pytestmark = pytest.mark.gpu
TOL = 1e-5
"""Relative error against the fp32 reference with fp32 output: the weight values are exact, so only the order of
the fp32 sums (the MMA's and the reference's) differs."""


def _case(fmt, per_row, e, n, k, tokens_per_expert, seed=0, tail=3, scale=0.02):
    return grouped_gemm_case(fmt, per_row, e, n, k, tokens_per_expert, seed, tail, scale)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("shape", [
    (5, 256, 512, [1, 0, 17, 3, 40]),     # every pass kind: 1 token, none, 8 < t <= 16 + 1, 3, several passes
    (3, 288, 768, [8, 9, 16]),            # N not a multiple of the CTA's 256 rows; K = 3 x 256 (odd step count)
    (4, 64, 2048, [2, 1, 5, 16]),         # one CTA, most warps idle; Qwen3's K
], ids=["k512", "k768", "k2048"])
def test_matches_reference(fmt, per_row, shape):
    e, n, k, tpe = shape
    x, wq, offs = _case(fmt, per_row, e, n, k, tpe)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    y = moe_mma.grouped_mm(x, wq, offs, out_dtype=torch.float32)
    assert _rel(y, ref) < TOL, _rel(y, ref)
    assert torch.equal(y[-3:], torch.zeros_like(y[-3:]))



@pytest.mark.parametrize("per_row", [False, True], ids=["tensor", "row"])
def test_saturated_encode_scale(per_row):
    """Weights whose global amax lies below 2688 / FLT_MAX: S_enc saturates at FLT_MAX in the kernel's column scale
    2**62 / S_enc as in the reference, whose outputs are nonzero (before the saturation both gave zeros)."""
    x, wq, offs = _case("nvfp4", per_row, 3, 256, 512, [1, 0, 17], scale=1e-38)
    assert float(wq.global_amax.max()) < 7.9e-36
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert ref[:18].abs().amax(-1).min() > 0
    y = moe_mma.grouped_mm(x, wq, offs, out_dtype=torch.float32)
    assert _rel(y * 2.0**100, ref * 2.0**100) < TOL, _rel(y * 2.0**100, ref * 2.0**100)  # (exact scaling: no underflow)

@pytest.mark.parametrize("k", [256, 768, 1024], ids=["1step", "3steps", "4steps"])
def test_a_cta_streams_several_row_blocks(monkeypatch, k):
    """One CTA per expert takes every block of 256 rows (the last one partial: some warps have one block fewer),
    with the steps of consecutive blocks in one pipeline, odd step counts included."""
    monkeypatch.setattr(moe_mma, "CTAS_PER_SM", 0)
    monkeypatch.setattr(moe_mma, "BALANCED", False)
    x, wq, offs = _case("nvfp4", True, 3, 800, k, [2, 19, 1])
    assert moe_mma.row_blocks_per_cta(3, 800, "cuda") == 4
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    y = moe_mma.grouped_mm(x, wq, offs, out_dtype=torch.float32)
    assert _rel(y, ref) < TOL
    assert torch.equal(y[-3:], torch.zeros_like(y[-3:]))


def test_bf16_out_rounds_the_fp32_result():
    x, wq, offs = _case("nvfp4", False, 4, 256, 1024, [3, 12, 0, 20])
    y32 = moe_mma.grouped_mm(x, wq, offs, out_dtype=torch.float32)
    y16 = moe_mma.grouped_mm(x, wq, offs)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.to(torch.bfloat16))


def test_long_k_takes_8_token_passes():
    k = 7168  # DeepSeek-V3's hidden size: 16 token rows do not fit in shared memory
    assert moe_mma.token_tile(k) == 8
    x, wq, offs = _case("nvfp4", False, 3, 64, k, [7, 19, 1])
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(moe_mma.grouped_mm(x, wq, offs, out_dtype=torch.float32), ref) < TOL


def test_repeated_launches_give_identical_bits():
    x, wq, offs = _case("nvfp4", False, 16, 512, 2048, [1, 4, 16, 9] * 4)
    first = moe_mma.grouped_mm(x, wq, offs)
    for _ in range(20):
        assert torch.equal(moe_mma.grouped_mm(x, wq, offs), first)


def test_w4a4_int64_offsets_and_no_tokens():
    x, wq, offs = _case("nvfp4", False, 4, 256, 512, [2, 0, 5, 1])
    xq = Quantizer("nvfp4").quantize(x)
    ref = grouped_mm_reference(xq, wq, offs, out_dtype=torch.float32)
    # (FP4 activations are dequantized to bf16 first, as in the Triton kernel: bf16 rounding)
    assert _rel(moe_mma.grouped_mm(xq, wq, offs.long(), out_dtype=torch.float32), ref) < 1e-2
    assert moe_mma.grouped_mm(x[:0], wq, torch.zeros_like(offs)).shape == (0, 256)


def test_special_scales_and_codes():
    """All-zero blocks (scale 0), the largest and the subnormal e4m3 scales, every pair of codes: exact products."""
    x, wq, offs = _case("nvfp4", False, 2, 64, 512, [5, 11], scale=1.0)
    sc = wq.block_scales.view(torch.uint8).clone()  # [E, N, K/16]
    sc[0, :8] = 0                  # zero scales
    sc[0, 8:16] = 0x7E             # 448, the largest finite e4m3
    sc[1, :8] = torch.arange(1, 9, dtype=torch.uint8, device="cuda")[:, None]  # e4m3 subnormals 2^-9 .. 7 * 2^-9, 2^-6
    codes = wq.codes.clone()       # [E, N, K/2]: K/2 = 256 bytes, every byte value once per row
    codes[1, 8:24] = torch.arange(256, dtype=torch.uint8, device="cuda").expand(16, 256)
    w = dataclasses.replace(wq, codes=codes, block_scales=sc.view(wq.block_scales.dtype))
    ref = grouped_mm_reference(x, w, offs, out_dtype=torch.float32)
    assert _rel(moe_mma.grouped_mm(x, w, offs, out_dtype=torch.float32), ref) < TOL


def test_nan_block_scale_gives_nan_rows():
    """A NaN scale byte (e4m3 0x7F) makes its weight row's outputs NaN, as dequantize-then-matmul does."""
    x, wq, offs = _case("nvfp4", False, 2, 64, 512, [3, 2])
    sc = wq.block_scales.view(torch.uint8).clone()
    sc[0, 5, 7] = 0x7F
    sc[1, 40, 31] = 0xFF
    w = dataclasses.replace(wq, block_scales=sc.view(wq.block_scales.dtype))
    ref = grouped_mm_reference(x, w, offs, out_dtype=torch.float32)
    y = moe_mma.grouped_mm(x, w, offs, out_dtype=torch.float32)
    assert torch.equal(y.isnan(), ref.isnan()) and int(y.isnan().sum()) == 3 + 2
    assert _rel(y.nan_to_num(0.0), ref.nan_to_num(0.0)) < TOL


def test_unsupported_calls_are_named():
    x, wq, offs = _case("nvfp4", False, 2, 48, 512, [1, 1])  # N % 32 != 0
    assert "N=48" in moe_mma.unsupported(x, wq)
    with pytest.raises(ValueError, match="N=48"):
        moe_mma.grouped_mm(x, wq, offs)
    assert "float16" in moe_mma.unsupported(x[:, :256], _case("nvfp4", False, 2, 64, 256, [1, 1])[1], torch.float16)
    x, wq, offs = _case("nvfp4", False, 2, 64, 320, [1, 1])
    assert "K=320" in moe_mma.unsupported(x, wq)
    # fp4_grouped_mm falls back to the Triton kernel there
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(fp4_grouped_mm(x, wq, offs, out_dtype=torch.float32, gemm="auto"), ref) < 2e-3


def test_fp4_grouped_mm_picks_the_cuda_kernel_where_asked(monkeypatch):
    x, wq, offs = _case("nvfp4", False, 8, 256, 1024, [4] * 8)
    ref = moe_mma.grouped_mm(x, wq, offs)
    assert torch.equal(fp4_grouped_mm(x, wq, offs, gemm="mma"), ref)
    from megatron_trace.kernels import moe_triton

    triton = moe_triton.grouped_mm(x, wq, offs)
    packed = moe_mma.pack(wq)
    monkeypatch.setattr(moe_mma, "AUTO", False)
    assert torch.equal(fp4_grouped_mm(x, wq, offs), triton)  # auto: Triton with AUTO off
    assert torch.equal(fp4_grouped_mm(x, wq, offs, packed=packed), triton)
    assert torch.equal(fp4_grouped_mm(x, packed, offs), ref)  # only the CUDA kernel reads the packed layout
    assert torch.equal(fp4_grouped_mm(x, packed, offs, gemm="triton"), triton)  # (unpacked first)
    monkeypatch.setattr(moe_mma, "AUTO", True)
    assert torch.equal(fp4_grouped_mm(x, wq, offs), triton)  # AUTO takes the CUDA kernel only with packed weights
    assert torch.equal(fp4_grouped_mm(x, wq, offs, packed=packed), ref)  # 32 rows, 4 per expert: preferred
    assert torch.equal(fp4_grouped_mm(x[:1], wq, offs.clamp(max=1), packed=packed),  # 1 row, 8 experts: not
                       moe_triton.grouped_mm(x[:1], wq, offs.clamp(max=1)))


@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("shape", [
    (5, 256, 512, [1, 0, 17, 3, 40]),
    (3, 288, 768, [8, 9, 16]),
    (3, 800, 1024, [2, 19, 1]),           # several row blocks per CTA (4 on the H200 with 3 experts)
    (3, 64, 7168, [7, 19, 1]),            # 8-token passes
], ids=["k512", "k768", "k1024-blocks", "k7168"])
def test_packed_weights_give_the_same_bits(fmt, per_row, shape):
    """The packed layout only moves bytes: the kernel's arithmetic and its order are the same, so are the bits."""
    e, n, k, tpe = shape
    x, wq, offs = _case(fmt, per_row, e, n, k, tpe)
    packed = moe_mma.pack(wq)
    for out_dtype in (torch.float32, torch.bfloat16):
        y = moe_mma.grouped_mm(x, wq, offs, out_dtype=out_dtype)
        assert torch.equal(moe_mma.grouped_mm(x, packed, offs, out_dtype=out_dtype), y)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(moe_mma.grouped_mm(x, packed, offs, out_dtype=torch.float32), ref) < TOL
    assert torch.equal(moe_mma.unpack(packed).codes, wq.codes)


def test_packed_nan_scale_and_special_scales():
    x, wq, offs = _case("nvfp4", False, 2, 64, 512, [3, 2], scale=1.0)
    sc = wq.block_scales.view(torch.uint8).clone()
    sc[0, 5, 7] = 0x7F              # NaN
    sc[1, :8] = torch.arange(1, 9, dtype=torch.uint8, device="cuda")[:, None]  # subnormals
    sc[1, 8:16] = 0x7E              # 448
    w = dataclasses.replace(wq, block_scales=sc.view(wq.block_scales.dtype))
    y = moe_mma.grouped_mm(x, w, offs, out_dtype=torch.float32)
    yp = moe_mma.grouped_mm(x, moe_mma.pack(w), offs, out_dtype=torch.float32)
    assert torch.equal(yp.isnan(), y.isnan()) and int(yp.isnan().sum()) == 3
    assert torch.equal(yp.nan_to_num(0.0), y.nan_to_num(0.0))


@pytest.mark.parametrize("ctas", [1, 3, 7, None], ids=["1cta", "3ctas", "7ctas", "wave"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_balanced_split_gives_the_grid_split_bits(monkeypatch, fmt, ctas):
    """The balanced split deals row blocks (x passes) of all experts to CTAs, a CTA's share spanning several
    experts, parts of an expert, or nothing; each output still comes from the same arithmetic, so the bits equal the
    one-grid-row-per-expert split's. Empty experts, one expert with several 16-token passes, rows of no expert."""
    monkeypatch.setattr(moe_mma, "GRID_CTAS", ctas)
    x, wq, offs = _case(fmt, fmt == "nvfp4", 9, 800, 512, [0, 1, 0, 0, 37, 2, 0, 16, 5])
    for weight in (wq, moe_mma.pack(wq)):
        monkeypatch.setattr(moe_mma, "BALANCED", False)
        grid = moe_mma.grouped_mm(x, weight, offs, out_dtype=torch.float32)
        monkeypatch.setattr(moe_mma, "BALANCED", True)
        assert torch.equal(moe_mma.grouped_mm(x, weight, offs, out_dtype=torch.float32), grid)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(grid, ref) < TOL and torch.equal(grid[-3:], torch.zeros_like(grid[-3:]))


def test_balanced_split_under_random_routing():
    """A decode batch's routing (random top-8 of 64 experts, some empty) on a full wave of CTAs."""
    gen = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.rand(16, 64, generator=gen).topk(8, dim=1).indices.flatten(), minlength=64)
    assert int((counts == 0).sum()) == 6 and int(counts.max()) == 5
    x, wq, offs = _case("nvfp4", False, 64, 256, 1024, counts.tolist())
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(moe_mma.grouped_mm(x, moe_mma.pack(wq), offs, out_dtype=torch.float32), ref) < TOL


def test_more_experts_than_threads_take_one_grid_row_each():
    """The balanced split gives each of its 256 threads one expert; with 300 experts the kernel keeps one grid row of
    CTAs per expert (and every expert's rows are still computed)."""
    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 3, (300,), generator=gen)
    x, wq, offs = _case("mxfp4", False, 300, 32, 256, counts.tolist())
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(moe_mma.grouped_mm(x, moe_mma.pack(wq), offs, out_dtype=torch.float32), ref) < TOL


def test_deepseek_v3_k_on_the_balanced_split():
    """K = 7168 takes 8-token passes; with 256 experts the balanced split still fits beside the token rows: an expert
    with 19 tokens takes 3 passes, most experts none."""
    counts = [0] * 256
    counts[3], counts[100], counts[255] = 19, 1, 8
    x, wq, offs = _case("nvfp4", False, 256, 32, 7168, counts)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(moe_mma.grouped_mm(x, moe_mma.pack(wq), offs, out_dtype=torch.float32), ref) < TOL
