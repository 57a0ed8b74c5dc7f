import dataclasses

import numpy as np
import pytest
import torch

from megatron_trace.formats import GuidanceMismatchError, mxfp4

from ._independent import e2m1_codes


def _one_block(amax: float) -> torch.Tensor:
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    x[0, 1] = -amax / 2
    return x


@pytest.mark.parametrize(
    "amax,e_floor,e_ceil",
    [(3.0, -1, -1), (5.0, 0, 0), (6.0, 0, 0), (7.0, 0, 1), (12.0, 1, 1), (0.001, -12, -12), (1.0, -2, -2)],
)
def test_scale_rules_hand_computed(amax, e_floor, e_ceil):
    # floor: floor(log2 amax) - 2 ; ceil: ceil(log2(amax / 6))
    for rule, e in (("floor", e_floor), ("ceil", e_ceil)):
        q = mxfp4.quantize(_one_block(amax), scale_rule=rule)
        assert q.block_scales.dtype == torch.float8_e8m0fnu
        assert mxfp4.scale_exponents(q.block_scales).item() == e, rule
        assert q.block_scales.view(torch.uint8).item() == e + 127


def test_floor_rule_saturates_ceil_rule_does_not():
    q_floor = mxfp4.quantize(_one_block(7.0), scale_rule="floor")
    q_ceil = mxfp4.quantize(_one_block(7.0), scale_rule="ceil")
    assert q_floor.dequantize()[0, 0].item() == 6.0  # 7 / 2^0 -> saturates at 6
    assert q_ceil.dequantize()[0, 0].item() == 8.0  # 7 / 2 = 3.5 -> 4 (tie to even) -> 8


def test_matches_independent():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 96, generator=g) * torch.logspace(-4, 4, 32).unsqueeze(1)
    for rule in ("floor", "ceil"):
        q = mxfp4.quantize(x, scale_rule=rule)
        xb = x.numpy().reshape(32, 3, 32).astype(np.float64)
        amax = np.abs(xb).max(-1)
        amax6 = amax.astype(np.float32) / np.float32(6)
        e = np.floor(np.log2(amax)) - 2 if rule == "floor" else np.ceil(np.log2(amax6))
        z = (xb / 2.0 ** e[..., None]).astype(np.float32)
        assert np.array_equal(mxfp4.scale_exponents(q.block_scales).numpy(), e.astype(np.int32))
        assert np.array_equal(q.unpacked_codes().numpy(), e2m1_codes(z).reshape(32, 96))


def test_zero_block_and_extremes():
    x = torch.zeros(2, 64)
    x[1, 40] = 3e38
    q = mxfp4.quantize(x)
    assert q.block_scales.view(torch.uint8)[0].tolist() == [0, 0]
    assert torch.equal(q.dequantize()[0], torch.zeros(64))
    assert torch.isfinite(q.dequantize()).all()
    tiny = mxfp4.quantize(torch.full((1, 32), 1e-39))
    assert torch.isfinite(tiny.dequantize()).all()


@pytest.mark.parametrize("amax_ulps,e_ceil", [(1, -127), (2, -127), (3, -127), (4, -127)])
def test_ceil_rule_tiny_amax(amax_ulps, e_ceil):
    # ceil(log2(fp32(amax / 6))) clamped at -127; amax <= 3 * 2**-149 makes amax / 6 underflow to 0, whose log2 is
    # -inf: the clamp's -127, as the Triton kernel (triton_fp4.mx_exponent) gives, not 0 (frexp(0)'s exponent)
    q = mxfp4.quantize(_one_block(amax_ulps * 2.0**-149), scale_rule="ceil")
    assert mxfp4.scale_exponents(q.block_scales).item() == e_ceil
    assert torch.equal(q.dequantize(), torch.zeros(1, 32))


def test_pow2_exact():
    e = torch.arange(-127, 128)
    assert torch.equal(mxfp4.pow2(e).double(), torch.pow(2.0, e.double()))


def test_odd_k_and_no_global_amax():
    q = mxfp4.quantize(torch.randn(3, 40))
    assert q.codes.shape == (3, 32) and q.block_scales.shape == (3, 2) and q.global_amax is None
    assert q.dequantize().shape == (3, 40)
    with pytest.raises(ValueError, match="no global amax"):
        mxfp4.MXFP4Format().global_amax(torch.randn(2, 32), per_row=True)


def test_bad_scale_rule():
    with pytest.raises(ValueError, match="scale_rule='round'"):
        mxfp4.quantize(torch.randn(2, 32), scale_rule="round")


def test_guidance_format_mismatch():
    x = torch.randn(2, 32)
    from megatron_trace.formats import nvfp4

    g = nvfp4.quantize(x, per_row=True).guidance(compact=True)
    with pytest.raises(GuidanceMismatchError, match="format 'nvfp4' != quantizer format 'mxfp4'"):
        mxfp4.guided_quantize(x, g)


def test_largest_finite_amax_gets_the_largest_reachable_exponents():
    # FLT_MAX = (2 - 2**-23) * 2**127: floor rule e = 127 - 2 (z ~ 8 saturates to 6); ceil rule
    # e = ceil(log2(FLT_MAX / 6)) = 126 (z ~ 4): the clamp at 127 is never reached by a finite input
    big = torch.finfo(torch.float32).max
    for rule, e, values in (("floor", 125, [6.0, -4.0]), ("ceil", 126, [4.0, -2.0])):
        q = mxfp4.quantize(_one_block(big), scale_rule=rule)
        assert mxfp4.scale_exponents(q.block_scales).item() == e, rule
        assert q.values()[0, :2].tolist() == values, rule
    assert q.dequantize()[0, 1].item() == -(2.0**127)  # (and 4 * 2**126 = 2**128 is beyond float32: inf)


def test_padding_does_not_move_the_scale_of_a_zero_tail_block():
    # K = 40: block 1 holds 8 real zeros and 24 padding elements; its scale is the all-zero block's (byte 0)
    x = torch.zeros(2, 40)
    x[:, :32] = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    for rule in ("floor", "ceil"):
        q = mxfp4.quantize(x, scale_rule=rule)
        assert q.block_scales.view(torch.uint8)[:, 1].tolist() == [0, 0] and q.unpacked_codes()[:, 32:].eq(0).all()
        assert q.padded_k == 64 and q.values().shape == (2, 40)


def test_a_record_with_a_global_amax_or_e4m3_scales_is_refused():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    rec = mxfp4.quantize(x).guidance(compact=False)
    with pytest.raises(GuidanceMismatchError, match="must not carry a global_amax"):
        mxfp4.guided_quantize(x, dataclasses.replace(rec, global_amax=torch.tensor(1.0)))
    # the same bytes read as E4M3 mean other scales: refused, not reinterpreted
    e4m3 = rec.block_scales.view(torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(GuidanceMismatchError, match="block_scales dtype torch.float8_e4m3fn != torch.float8_e8m0fnu"):
        mxfp4.guided_quantize(x, dataclasses.replace(rec, block_scales=e4m3))
