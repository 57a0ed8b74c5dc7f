import dataclasses

import numpy as np
import pytest
import torch

from megatron_trace.formats import FP4Tensor, GuidanceMismatchError, NonFiniteError, Quantizer, e2m1, mxfp4, nvfp4

from ._independent import E4M3, e4m3_rn_sat
from ._independent import nvfp4 as nvfp4_independent


def test_e4m3_cast_matches_independent_rounding():
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.rand(20000, generator=g) * 500, torch.rand(5000, generator=g) * 0.02,
                   torch.tensor(E4M3[1:], dtype=torch.float32),
                   torch.tensor((E4M3[1:] + E4M3[:-1]) / 2, dtype=torch.float32)])
    # NVFP4 block scales use torch's float8 cast after a clamp at 448: check it against the brute force
    ours = v.clamp(max=448).to(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(ours, e4m3_rn_sat(v.numpy()))


def test_block_and_global_scale_hand_computed():
    # one row of 16: amax_block = 3.0, global amax (per tensor) = 3.0
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, -1.0, 0.3
    q = nvfp4.quantize(x)
    assert q.global_amax.item() == 3.0
    # S_enc = 2688 / 3 = 896; sf = e4m3(896 * 3 / 6) = e4m3(448) = 448
    assert q.block_scales.float().item() == 448.0
    # z = x * 896 / 448 = 2x -> 6, -2, 0.6 -> codes 6 (0b0111), -2 (0b1100), 0.5 (0b0001)
    codes = q.unpacked_codes()[0]
    assert codes[:3].tolist() == [0b0111, 0b1100, 0b0001]
    assert q.dequantize()[0, :3].tolist() == [3.0, -1.0, 0.25]


def test_block_scale_rounds_to_e4m3():
    # global amax 10 (second block); block amax 1: sf = e4m3(268.8 * 1 / 6) = e4m3(44.8) = 44
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    x[0, 16] = 10.0
    q = nvfp4.quantize(x)
    s_enc = np.float32(2688.0) / np.float32(10.0)
    expected = e4m3_rn_sat(np.array([s_enc * np.float32(1.0) / np.float32(6.0)], dtype=np.float32))[0]
    assert q.block_scales.float()[0, 0].item() == expected == 44.0
    # z = 1 * 268.8 / 44 = 6.109 -> saturates to 6; x_hat = 6 * 44 / 268.8
    assert q.values()[0, 0].item() == 6.0
    assert q.dequantize()[0, 0].item() == pytest.approx(6 * 44 / 268.8, rel=1e-6)


def test_matches_independent_per_row():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q = nvfp4.quantize(x, per_row=True)
    codes, sf = nvfp4_independent(x.numpy(), q.global_amax.numpy())
    assert np.array_equal(q.unpacked_codes().numpy(), codes)
    assert np.array_equal(q.block_scales.float().numpy(), sf)


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes_agree_with_fp32_of_same_values(dtype, per_row):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 48, generator=g) * 5).to(dtype)
    a, b = nvfp4.quantize(x, per_row=per_row), nvfp4.quantize(x.float(), per_row=per_row)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))
    assert a.dequantize(dtype).dtype == dtype


def test_zero_block_zero_scale_zero_codes_no_nan():
    x = torch.zeros(3, 32)
    x[1, 20] = 2.0  # second row: first block zero, second not
    q = nvfp4.quantize(x, per_row=True)
    assert q.block_scales.float()[0].tolist() == [0.0, 0.0]
    assert q.block_scales.float()[1, 0].item() == 0.0
    assert not torch.isnan(q.dequantize()).any()
    assert torch.equal(q.dequantize()[0], torch.zeros(32))
    assert q.unpacked_codes()[0].eq(0).all()


def test_subnormal_and_huge_inputs():
    x = torch.tensor([[1e-40, -1e-39, 3e38, -3e38] + [0.0] * 12])
    q = nvfp4.quantize(x, per_row=True)
    d = q.dequantize()
    assert torch.isfinite(d).all()
    assert d[0, 2].item() == pytest.approx(3e38, rel=0.01)
    assert d[0, 0].item() == 0.0  # far below the block's resolution


def test_underflowing_block_scale_gives_zero_codes():
    # block amax so small relative to the global amax that sf rounds to 0 in e4m3
    x = torch.zeros(1, 32)
    x[0, 0] = 1e-9
    x[0, 16] = 1e3
    q = nvfp4.quantize(x)
    assert q.block_scales.float()[0, 0].item() == 0.0
    assert q.unpacked_codes()[0, :16].eq(0).all()


def test_odd_shape_pads_and_trims():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 21, generator=g)
    q = nvfp4.quantize(x, per_row=True)
    assert q.codes.shape == (3, 5, 16) and q.block_scales.shape == (3, 5, 2) and q.global_amax.shape == (3, 5, 1)
    assert q.shape == (3, 5, 21) and q.dequantize().shape == (3, 5, 21)
    padded = torch.nn.functional.pad(x, (0, 11))
    qp = nvfp4.quantize(padded, per_row=True)
    assert torch.equal(qp.codes, q.codes)


def test_non_contiguous_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    xt = x.t()
    assert not xt.is_contiguous()
    assert torch.equal(nvfp4.quantize(xt, per_row=True).codes, nvfp4.quantize(xt.contiguous(), per_row=True).codes)


def test_global_amax_granularities():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    assert nvfp4.quantize(x).global_amax.shape == ()
    assert nvfp4.quantize(x, per_row=True).global_amax.shape == (4, 1)
    static = nvfp4.quantize(x, global_amax=10.0)
    assert static.global_amax.item() == 10.0
    # per-row amax is batch-invariant: a row quantizes the same alone or in a batch
    assert torch.equal(nvfp4.quantize(x[1:2], per_row=True).codes, nvfp4.quantize(x, per_row=True).codes[1:2])


def test_static_amax_smaller_than_data_saturates_scales():
    x = torch.full((1, 16), 100.0)
    q = nvfp4.quantize(x, global_amax=1.0)
    assert q.block_scales.float().item() == 448.0
    assert q.values().eq(6.0).all()


def test_modelopt_decode_scale_convention():
    amax = torch.tensor(2688.0)
    assert nvfp4.decode_scale_from_amax(amax).item() == 1.0
    assert nvfp4.encode_scale(amax).item() == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises(bad):
    x = torch.zeros(2, 16)
    x[1, 3] = bad
    with pytest.raises(NonFiniteError, match=r"1 NaN/Inf value\(s\) \(first at index \(1, 3\)\)"):
        nvfp4.quantize(x)


def test_bad_inputs_raise_clearly():
    with pytest.raises(TypeError, match="dtype=torch.int64"):
        nvfp4.quantize(torch.zeros(2, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-empty last dim"):
        nvfp4.quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="finite and > 0"):
        nvfp4.quantize(torch.ones(2, 16), global_amax=0.0)
    with pytest.raises(ValueError, match="not both"):
        nvfp4.quantize(torch.ones(2, 16), global_amax=1.0, per_row=True)
    with pytest.raises(ValueError, match="rounding='up'"):
        nvfp4.quantize(torch.ones(2, 16), rounding="up")
    with pytest.raises(ValueError, match=r"scale_rule='cieling' is not one of \('floor', 'ceil'\)"):
        Quantizer("nvfp4", scale_rule="cieling")  # (MXFP4's rule: still a typo to report for NVFP4)


def test_dequantize_is_grid_times_scales():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=g)
    q = nvfp4.quantize(x, per_row=True)
    vals = e2m1.decode(q.unpacked_codes()).view(6, 2, 16)
    s_enc = torch.full_like(q.global_amax, 2688.0) / q.global_amax
    expected = (vals * q.block_scales.float().unsqueeze(-1) / s_enc.unsqueeze(-1)).view(6, 32)
    assert torch.equal(q.dequantize(), expected)
    assert isinstance(q, FP4Tensor) and q.fmt == "nvfp4"


def test_encode_scale_is_one_ieee_division():
    g = torch.Generator().manual_seed(9)
    amax = torch.rand(100000, generator=g) * 1000 + 1e-3
    expected = np.float32(2688.0) / amax.numpy()  # numpy: one correctly rounded fp32 division
    assert np.array_equal(nvfp4.encode_scale(amax).numpy(), expected)


@pytest.mark.parametrize("compact", [False, True])
def test_zero_rows(compact):
    # an expert-parallel rank can receive no tokens: empty inputs work end to end
    x = torch.zeros(0, 48, dtype=torch.bfloat16)
    q = nvfp4.quantize(x, per_row=True)
    assert q.codes.shape == (0, 24) and q.block_scales.shape == (0, 3) and q.dequantize().shape == (0, 48)
    assert nvfp4.guided_quantize(x, q.guidance(compact=compact)).codes.shape == (0, 24)


_FLT_MAX = torch.finfo(torch.float32).max
_SATURATES = float(np.float32(2688.0) / np.float32(_FLT_MAX))  # fp32(2688 / FLT_MAX) ~= 7.9e-36


def test_encode_scale_saturates_at_float32_max():
    # Transformer Engine's rule: min(2688 / amax, FLT_MAX); at the threshold the division itself stays finite
    tiny = torch.tensor([np.nextafter(np.float32(_SATURATES), np.float32(0)), 1e-37, 2e-38, 1e-40, 2.0**-149])
    assert torch.equal(nvfp4.encode_scale(tiny), torch.full_like(tiny, _FLT_MAX))
    edge = torch.tensor([_SATURATES, 8e-36])
    assert torch.equal(nvfp4.encode_scale(edge), torch.from_numpy(np.float32(2688.0) / edge.numpy()))
    assert (nvfp4.encode_scale(edge) < _FLT_MAX).all()


@pytest.mark.parametrize("per_row", [False, True])
def test_tiny_global_amax_gives_valid_codes_and_scales(per_row):
    # amax below 2688 / FLT_MAX: before the saturation S_enc was inf, every code +-6, a zero block's scale NaN
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g) * 1e-37
    x[1, 16:32] = 0.0  # an all-zero block
    x[2] *= 1e-3  # a row down to fp32 subnormals
    q = nvfp4.quantize(x, per_row=per_row)
    assert torch.equal(nvfp4.encode_scale(q.global_amax), torch.full_like(q.global_amax, _FLT_MAX))
    amax = q.global_amax.expand(4, 1).numpy() if per_row else np.full((4, 1), q.global_amax.item(), np.float32)
    codes, sf = nvfp4_independent(x.numpy(), amax)
    assert np.array_equal(q.unpacked_codes().numpy(), codes)
    assert np.array_equal(q.block_scales.float().numpy(), sf)
    assert not q.block_scales.float().isnan().any() and q.block_scales.float()[1, 1].item() == 0.0
    d = q.dequantize()
    assert torch.isfinite(d).all() and d[1, 16:32].eq(0).all()
    # the block amax is represented (not flushed, not saturated) where its block scale is a normal e4m3
    xb, db, sb = x.view(4, 4, 16), d.view(4, 4, 16), q.block_scales.float()
    normal = sb >= 2.0**-6
    assert normal[0].all() and normal.sum() >= 10
    err = (xb - db).abs().amax(-1) / xb.abs().amax(-1)
    assert (err[normal] <= 0.25).all()


@pytest.mark.parametrize("compact", [False, True])
def test_tiny_global_amax_guided_reproduces_its_record(compact):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 32, generator=g) * 3e-38
    x[1, 16:] = 0.0  # an all-zero block: its scale was NaN before the saturation
    q = nvfp4.quantize(x, per_row=True)
    out = nvfp4.guided_quantize(x * 1.01, q.guidance(compact=compact))  # drifted inputs, the rollout's scales
    assert torch.equal(out.block_scales.view(torch.uint8), q.block_scales.view(torch.uint8))
    assert not out.block_scales.float().isnan().any() and torch.isfinite(out.dequantize()).all()
    assert (out.unpacked_codes() != q.unpacked_codes()).float().mean() < 0.1  # 1% drift rarely moves a code
    assert torch.equal(nvfp4.guided_quantize(x, q.guidance(compact=compact)).codes, q.codes)


def test_decode_scale_where_the_encode_scale_saturates_is_one_over_flt_max():
    # S_enc = FLT_MAX there, so the ModelOpt decode scale is fp32(1 / FLT_MAX) = 2**-128, not amax / 2688
    tiny = torch.tensor([1e-37, 2e-38, 2.0**-149])
    assert torch.equal(nvfp4.decode_scale_from_amax(tiny), torch.full_like(tiny, 2.0**-128))
    normal = torch.tensor([_SATURATES, 1.0, 2688.0, 1e30])
    assert torch.equal(nvfp4.decode_scale_from_amax(normal), torch.from_numpy(normal.numpy() / np.float32(2688.0)))
    x = torch.tensor([[1e-37, -3e-38, 5e-38, 0.0] * 4])
    q = nvfp4.quantize(x)  # per tensor: global_amax 1e-37, S_enc saturated
    modelopt = q.values() * q.block_scales.float().repeat_interleave(16, -1) * nvfp4.decode_scale_from_amax(
        q.global_amax)
    assert torch.allclose(modelopt, q.dequantize(), rtol=1e-6, atol=0) and q.dequantize().abs().max() > 0


def _nudge(v: np.ndarray, ulps: np.ndarray) -> np.ndarray:
    """float32 ``v`` moved by ``ulps`` (signed ints) representable steps."""
    v = v.astype(np.float32)
    for _ in range(int(np.abs(ulps).max())):
        up, down = np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))
        v = np.where(ulps > 0, up, np.where(ulps < 0, down, v))
        ulps = ulps - np.sign(ulps)
    return v.astype(np.float32)


def test_bin_edges_match_independent():
    """Block amaxes within a few ulps of e4m3 rounding midpoints and elements within a few ulps of E2M1 ties:
    where the order of the fp32 operations (S_enc * amax / 6, x * S_enc / sf) decides the bits."""
    rng = np.random.default_rng(0)
    rows = 1024
    g = rng.uniform(0.5, 1000, rows).astype(np.float32)  # the row's amax: element 0 of block 1
    s = np.float32(2688.0) / g
    mids = (E4M3[1:] + E4M3[:-1]) / 2
    mids = mids[(mids > 0.05) & (mids < 440)]
    a = _nudge((rng.choice(mids, rows) * 6 / s).astype(np.float32), rng.integers(-3, 4, rows))
    a = np.minimum(a, g)
    sf = e4m3_rn_sat((s * a / np.float32(6.0)).astype(np.float32))  # block 0's scale (checked below too)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    t = rng.choice(ties, (rows, 15)) * rng.choice([-1.0, 1.0], (rows, 15)).astype(np.float32)
    elems = _nudge((t * sf[:, None] / s[:, None]).astype(np.float32), rng.integers(-2, 3, (rows, 15)))
    elems = np.clip(elems, -a[:, None], a[:, None])
    x = np.zeros((rows, 32), dtype=np.float32)
    x[:, 0], x[:, 1:16], x[:, 16] = a, elems, g
    x[:, 17:] = _nudge((rng.choice(ties, (rows, 15)) * g[:, None] / 6).astype(np.float32),
                       rng.integers(-2, 3, (rows, 15)))
    q = nvfp4.quantize(torch.from_numpy(x), per_row=True)
    codes, sf_ind = nvfp4_independent(x, q.global_amax.numpy())
    assert np.array_equal(q.global_amax.numpy()[:, 0], g)
    assert np.array_equal(q.block_scales.float().numpy(), sf_ind)
    assert np.array_equal(q.unpacked_codes().numpy(), codes)
    # the edges are hit exactly: block scales at e4m3 midpoints before rounding, scaled elements at E2M1 ties
    assert np.isin((s * a) / np.float32(6.0), mids).sum() > 50
    z = (x[:, 1:16] * s[:, None]) / sf[:, None]
    assert np.isin(np.abs(z), ties).sum() > 1000


def test_encode_and_decode_scale_of_a_zero_amax():
    # S_enc = 1 (not saturated: an all-zero tensor is not a tiny one); ModelOpt's decode scale is then 0 / 2688 = 0
    zero = torch.zeros(3)
    assert torch.equal(nvfp4.encode_scale(zero), torch.ones(3))
    assert torch.equal(nvfp4.decode_scale_from_amax(zero), zero)


def test_decode_scale_is_one_ieee_division():
    g = torch.Generator().manual_seed(10)
    amax = torch.rand(100000, generator=g) * 1000 + 1e-3
    assert np.array_equal(nvfp4.decode_scale_from_amax(amax).numpy(), amax.numpy() / np.float32(2688.0))


def test_global_amax_is_the_largest_magnitude():
    x = torch.zeros(2, 40)
    x[0, :2], x[1, :2], x[1, 37] = torch.tensor([1.0, -5.0]), torch.tensor([-0.5, 0.25]), -0.75
    assert nvfp4.quantize(x).global_amax.item() == 5.0
    assert nvfp4.quantize(x, per_row=True).global_amax[:, 0].tolist() == [5.0, 0.75]
    # a tensor without elements has amax 0 (an EP rank without tokens)
    assert nvfp4.quantize(torch.zeros(0, 16)).global_amax.item() == 0.0


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0])
def test_a_given_global_amax_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match=rf"finite and > 0, got \[1.0, {bad}\]"):
        nvfp4.quantize(torch.ones(2, 16), global_amax=torch.tensor([[1.0], [bad]]))


@pytest.mark.parametrize("kw,err,match", [
    # were: per_row="no" accepted (truthy: one amax per row); True taken as amax 1.0; a string a bare torch error
    (dict(per_row="no"), ValueError, "per_row='no' must be a bool"),
    (dict(global_amax=True), TypeError, "global_amax=True must be a number or a float32 tensor"),
    (dict(global_amax="2.0"), TypeError,
     r"global_amax='2.0' must be a number or a float32 tensor \(\[\] or \(2, 1\)\)"),
])
def test_bad_quantize_arguments_are_named(kw, err, match):
    with pytest.raises(err, match=match):
        nvfp4.quantize(torch.ones(2, 16), **kw)


@pytest.mark.parametrize("quantize", [nvfp4.quantize, mxfp4.quantize], ids=["nvfp4", "mxfp4"])
def test_a_meta_tensor_is_refused_by_name(quantize):
    with pytest.raises(ValueError, match=r"x is a meta tensor \(shape \(2, 32\), no values\)"):  # (was: Tensor.item())
        quantize(torch.empty(2, 32, device="meta"))


def test_a_one_dim_global_amax_is_refused():
    # [rows] (not [rows, 1]) would broadcast along the blocks of a row, not along the rows
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(GuidanceMismatchError, match=r"global_amax shape \(4,\) must be \[\] \(per tensor\) or"):
        nvfp4.quantize(x, global_amax=torch.ones(4))


def test_an_nvfp4_record_without_global_amax_is_refused():
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    rec = dataclasses.replace(nvfp4.quantize(x).guidance(compact=True), global_amax=None)
    with pytest.raises(GuidanceMismatchError, match="needs a float32 global_amax tensor, got NoneType"):
        nvfp4.guided_quantize(x, rec)


def test_an_empty_last_dim_is_refused():
    with pytest.raises(ValueError, match=r"non-empty last dim, got shape \(2, 0\)"):
        nvfp4.quantize(torch.zeros(2, 0))


def test_padding_does_not_move_the_scale_of_a_zero_tail_block():
    # K = 21: block 1 holds 5 real zeros and 11 padding elements; its scale is that of an all-zero block
    x = torch.zeros(2, 21)
    x[:, :16] = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    q = nvfp4.quantize(x, per_row=True)
    assert q.block_scales.float()[:, 1].tolist() == [0.0, 0.0] and q.unpacked_codes()[:, 16:].eq(0).all()
    assert q.padded_k == 32 and q.values().shape == (2, 21)
    assert torch.equal(q.values(), e2m1.decode(q.unpacked_codes())[:, :21])
