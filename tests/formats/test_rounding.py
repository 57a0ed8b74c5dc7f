"""Stochastic and guided rounding (DESIGN.md §2), with hypothesis property tests."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.formats import GuidanceMismatchError, e2m1, mxfp4, nvfp4, rounding

FORMATS = {
    "nvfp4": lambda x: nvfp4.quantize(x, per_row=True),
    "mxfp4": lambda x: mxfp4.quantize(x),
}
GUIDED = {"nvfp4": nvfp4.guided_quantize, "mxfp4": mxfp4.guided_quantize}

rows = st.integers(1, 6)
seeds = st.integers(0, 2**31 - 1)


def _data(seed, n, k=64, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * scale * torch.rand(n, 1, generator=g).add(0.05)


def test_stochastic_is_unbiased():
    z = torch.tensor([0.1, 0.3, 1.2, 2.2, 2.9, 4.5, -0.7, -5.5]).repeat(40000, 1)
    g = torch.Generator().manual_seed(0)
    mean = e2m1.decode(rounding.stochastic(z, g)).mean(0)
    lo, hi = e2m1.bracket(z[0])
    var = (hi - z[0]) * (z[0] - lo)  # Bernoulli variance times width^2
    bound = 5 * torch.sqrt(var / 40000) + 1e-6
    assert torch.all((mean - z[0]).abs() <= bound), (mean, z[0])


def test_stochastic_deterministic_with_seed_and_exact_on_grid():
    z = torch.linspace(-7, 7, 999)
    a = rounding.stochastic(z, torch.Generator().manual_seed(7))
    b = rounding.stochastic(z, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    on_grid = torch.tensor(e2m1.SIGNED_GRID)
    assert torch.equal(e2m1.decode(rounding.stochastic(on_grid)), on_grid)


def test_stochastic_rounds_up_exactly_where_the_uniform_draw_is_below_p_hi():
    # P(hi) = (z - lo) / (hi - lo) with u ~ U[0, 1) the generator's float32 draws, one per element in order;
    # the bracket by exhaustive search over the 15 signed grid values
    z = torch.cat([torch.linspace(-7, 7, 4001), torch.randn(4000, generator=torch.Generator().manual_seed(2)) * 3])
    grid = torch.tensor(e2m1.SIGNED_GRID, dtype=torch.float64)
    zc = z.double().clamp(-6, 6)
    lo = torch.where(grid <= zc[:, None], grid, -torch.inf).amax(-1)
    hi = torch.where(grid >= zc[:, None], grid, torch.inf).amin(-1)
    u = torch.rand(z.shape, generator=torch.Generator().manual_seed(3)).double()
    p_hi = torch.where(hi > lo, (zc - lo) / (hi - lo).clamp(min=0.5), 0.0)
    want = torch.where(u < p_hi, hi, lo)
    got = e2m1.decode(rounding.stochastic(z, torch.Generator().manual_seed(3))).double()
    assert torch.equal(got, want)


def test_stochastic_through_nvfp4():
    x = _data(0, 4)
    q1 = nvfp4.quantize(x, per_row=True, rounding="stochastic", generator=torch.Generator().manual_seed(1))
    q2 = nvfp4.quantize(x, per_row=True, rounding="stochastic", generator=torch.Generator().manual_seed(1))
    assert torch.equal(q1.codes, q2.codes)
    own = nvfp4.quantize(x, per_row=True)
    assert torch.equal(q1.block_scales.view(torch.uint8), own.block_scales.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("compact", [False, True])
@settings(max_examples=25, deadline=None)
@given(seed=seeds, n=rows)
def test_a_own_guidance_reproduces_rne_exactly(fmt, compact, seed, n):
    x = _data(seed, n).to(torch.bfloat16)
    q = FORMATS[fmt](x)
    g = GUIDED[fmt](x, q.guidance(compact=compact))
    assert torch.equal(g.codes, q.codes)
    assert torch.equal(g.block_scales.view(torch.uint8), q.block_scales.view(torch.uint8))


def _perturbed_case(fmt, seed, n, noise):
    x = _data(seed, n)
    gen = torch.Generator().manual_seed(seed + 1)
    xp = x + noise * torch.randn(x.shape, generator=gen) * x.abs().amax(-1, keepdim=True) / 6
    roll = FORMATS[fmt](x)
    # the trainer's own RNE with the rollout's scales: the bracket baseline
    z = _z(fmt, xp, roll)
    q_rtn = e2m1.decode(rounding.rne(z))
    lo, hi = e2m1.bracket(z)
    return x, xp, roll, z, q_rtn, lo, hi


def _z(fmt, x, q):
    from megatron_trace.formats import block, get_format

    f = get_format(fmt)
    return f.scale_values(block.to_blocks(x, f.block_size), q.block_scales, q.global_amax).flatten(-2)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@settings(max_examples=25, deadline=None)
@given(seed=seeds, n=rows, noise=st.sampled_from([0.01, 0.05, 0.3]))
def test_b_c_d_guided_properties(fmt, seed, n, noise):
    x, xp, roll, z, q_rtn, lo, hi = _perturbed_case(fmt, seed, n, noise)
    q_roll = roll.values()
    full = GUIDED[fmt](xp, roll.guidance(compact=False)).values()
    comp = GUIDED[fmt](xp, roll.guidance(compact=True)).values()
    in_bracket = (q_roll == lo) | (q_roll == hi)
    # (b) guided equals the rollout wherever the rollout's code is one of the trainer's bracket points
    assert torch.equal(full[in_bracket], q_roll[in_bracket])
    assert torch.equal(comp[in_bracket], q_roll[in_bracket])
    # (c) elementwise guarantee of full mode
    assert torch.all((full - q_roll).abs() <= (q_rtn - q_roll).abs())
    # (d) compact == full wherever the mismatch is adjacent
    assert torch.equal(comp[in_bracket], full[in_bracket])
    # and the guided result is always a bracket point of the trainer's own value
    assert torch.all((full == lo) | (full == hi)) and torch.all((comp == lo) | (comp == hi))


def test_guided_removes_small_perturbation_mismatch():
    x, xp, roll, z, q_rtn, lo, hi = _perturbed_case("nvfp4", 0, 256, 0.02)
    q_roll = roll.values()
    rtn_mismatch = (q_rtn != q_roll).float().mean().item()
    guided = nvfp4.guided_quantize(xp, roll.guidance(compact=True)).values()
    assert rtn_mismatch > 0.005
    assert (guided != q_roll).float().mean().item() < rtn_mismatch / 20


def test_full_mode_reproduces_negative_zero():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -0.01
    roll = nvfp4.quantize(x, per_row=True)
    assert roll.unpacked_codes()[0, 1].item() == 8
    xp = x.clone()
    xp[0, 1] = 0.01
    assert nvfp4.guided_quantize(xp, roll.guidance(compact=False)).unpacked_codes()[0, 1].item() == 8


@pytest.mark.parametrize("ste_clip", [False, True])
def test_e_ste_gradient(ste_clip):
    from megatron_trace.formats import fake_quantize

    x = _data(3, 4).requires_grad_()
    roll = nvfp4.quantize(x.detach() / 1.5, per_row=True)  # rollout scales too small: some |z| > 6
    for guidance in (None, roll.guidance(compact=True)):
        x.grad = None
        y = fake_quantize(x, "nvfp4", per_row=True, guidance=guidance, ste_clip=ste_clip)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
        (y * w).sum().backward()
        if not ste_clip:
            assert torch.equal(x.grad, w)
        else:
            z = _z("nvfp4", x.detach(), roll if guidance is not None else nvfp4.quantize(x.detach(), per_row=True))
            assert torch.equal(x.grad, w * (z.abs() <= 6))
    assert ste_clip is False or bool((z.abs() > 6).any())


def test_guided_shape_and_dtype_errors():
    x = _data(0, 4)
    g = nvfp4.quantize(x, per_row=True).guidance(compact=True)
    with pytest.raises(GuidanceMismatchError, match=r"guidance is for shape \(4, 64\), tensor has shape \(3, 64\)"):
        nvfp4.guided_quantize(x[:3], g)
    with pytest.raises(TypeError, match="FullGuidance or CompactGuidance"):
        nvfp4.guided_quantize(x, nvfp4.quantize(x))
    bad = type(g)(mantissa_bits=g.mantissa_bits[:, :4], block_scales=g.block_scales, global_amax=g.global_amax,
                  shape=g.shape, fmt=g.fmt)
    with pytest.raises(GuidanceMismatchError, match="payload"):
        nvfp4.guided_quantize(x, bad)
    bad = type(g)(mantissa_bits=g.mantissa_bits, block_scales=g.block_scales, global_amax=g.global_amax[:2],
                  shape=g.shape, fmt=g.fmt)
    with pytest.raises(GuidanceMismatchError, match="global_amax shape"):
        nvfp4.guided_quantize(x, bad)
    with pytest.raises(ValueError, match="mantissa bits shape"):
        rounding.guided_compact(torch.zeros(3), torch.zeros(2, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("compact", [False, True])
def test_a_record_of_another_last_dim_with_the_same_blocks_is_refused(fmt, compact):
    # K = 20 and K = 32 have the same block count (and so the same payload and scale shapes): only the
    # recorded shape tells them apart
    x = _data(0, 4, k=32)
    rec = FORMATS[fmt](x[:, :20]).guidance(compact=compact)
    with pytest.raises(GuidanceMismatchError, match=r"guidance is for shape \(4, 20\), tensor has shape \(4, 32\)"):
        GUIDED[fmt](x, rec)


def test_a_per_row_amax_of_other_rows_is_refused_in_every_leading_dim():
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    rec = nvfp4.quantize(x, per_row=True).guidance(compact=False)  # global_amax [2, 3, 1]
    for shape in [(2, 1, 1), (2, 3, 2), (2, 1)]:  # same first dim as x: each broadcasts without the check
        bad = dataclasses.replace(rec, global_amax=torch.ones(shape))
        with pytest.raises(GuidanceMismatchError, match=r"global_amax shape .* must be \[\] \(per tensor\) or "
                           r"\(2, 3, 1\)"):
            nvfp4.guided_quantize(x, bad)
        with pytest.raises(GuidanceMismatchError, match="global_amax shape"):
            nvfp4.quantize(x, global_amax=torch.ones(shape))


def test_stochastic_zero_results_carry_the_sign_of_z():
    z = torch.tensor([1e-30, -1e-30, 0.0, -0.0, 0.1, -0.1, 0.2, -0.2] * 8)
    codes = rounding.stochastic(z, torch.Generator().manual_seed(0))
    assert torch.equal(codes[:4], torch.tensor([0, 8, 0, 8], dtype=torch.uint8))  # P(nonzero): ~1e-30 or 0
    zero = e2m1.decode(codes) == 0  # and those of +-0.1, +-0.2 that rounded to zero: signed like z, as RNE's
    assert torch.equal(codes[zero], torch.signbit(z[zero]).to(torch.uint8) << 3) and zero[4:].any()


def test_full_to_compact_equals_direct_compact():
    q = nvfp4.quantize(_data(4, 3), per_row=True)
    a, b = q.guidance(compact=False).to_compact(), q.guidance(compact=True)
    assert torch.equal(a.mantissa_bits, b.mantissa_bits) and a.shape == b.shape


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_stochastic_rounding_by_name_draws_from_the_generator(fmt):
    from megatron_trace.formats import Quantizer

    x = _data(5, 4)
    own = FORMATS[fmt](x)
    z = _z(fmt, x, own)  # the own scales (stochastic rounding does not change them)
    want = rounding.stochastic(z, torch.Generator().manual_seed(11))
    assert not torch.equal(want, rounding.rne(z))
    quant = {"nvfp4": nvfp4.quantize, "mxfp4": mxfp4.quantize}[fmt]
    kw = {"per_row": True} if fmt == "nvfp4" else {}
    q = quant(x, rounding="stochastic", generator=torch.Generator().manual_seed(11), **kw)
    assert torch.equal(q.unpacked_codes(), want)
    qz = Quantizer(fmt, per_row=fmt == "nvfp4", rounding="stochastic")
    assert torch.equal(qz.quantize(x, generator=torch.Generator().manual_seed(11)).unpacked_codes(), want)


def test_guided_full_zero_of_its_own_carries_the_sign_of_z():
    # the rollout's +1 is outside the bracket (-0.5, 0) of z = -0.1: the nearest point 0 is emitted as -0 (like RNE)
    z = torch.tensor([-0.1, 0.1, -0.3])
    roll = torch.tensor([2, 10, 2], dtype=torch.uint8)  # +1, -1, +1
    assert rounding.guided_full(z, roll).tolist() == [8, 0, 8]
    with pytest.raises(ValueError, match=r"rollout codes shape \(1, 3\) != values shape \(2, 3\)"):
        rounding.guided_full(torch.zeros(2, 3), torch.zeros(1, 3, dtype=torch.uint8))  # (would broadcast)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_record_with_other_block_scales_or_payload_dtype_is_refused(fmt):
    x = _data(6, 4)
    rec = FORMATS[fmt](x).guidance(compact=False)
    one, nb = rec.block_scales[:, :1], rec.block_scales.shape[-1]  # [4, 1] broadcasts over a row's blocks
    with pytest.raises(GuidanceMismatchError, match=rf"block_scales shape \(4, 1\) != \(4, {nb}\)"):
        GUIDED[fmt](x, dataclasses.replace(rec, block_scales=one))
    with pytest.raises(GuidanceMismatchError, match=r"payload torch.int8 \(4, 32\) != torch.uint8 \(4, 32\)"):
        GUIDED[fmt](x, dataclasses.replace(rec, codes=rec.codes.view(torch.int8)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_to_compact_keeps_every_field(fmt):
    q = FORMATS[fmt](_data(4, 3, k=40))
    a, b = q.guidance(compact=False).to_compact(), q.guidance(compact=True)
    assert torch.equal(a.mantissa_bits, b.mantissa_bits) and torch.equal(a.block_scales.view(torch.uint8),
                                                                         b.block_scales.view(torch.uint8))
    assert a.shape == b.shape == (3, 40) and a.fmt == b.fmt == fmt
    assert (a.global_amax is None) == (fmt == "mxfp4") and (fmt == "mxfp4" or torch.equal(a.global_amax, b.global_amax))
    assert torch.equal(GUIDED[fmt](_data(4, 3, k=40), a).codes, q.codes)
