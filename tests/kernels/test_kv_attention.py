"""Decode attention over an FP4 KV cache: the torch reference (CPU) and its dispatch; the Triton kernels on
small shapes (CUDA, or Triton's CPU interpreter with ``TRITON_INTERPRET=1``: Triton-op dequantization instead
of the inline PTX, fp32 dots). The GPU shapes and the PTX path: tests/gpu/test_kv_attention_gpu.py."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_trace.formats import Quantizer
from megatron_trace.kernels.kv_attention import dense_decode_attention, fp4kv_decode_attention, reference_attention

from ._gpu import DEVICE, HAS_TRITON, INTERPRET, needs_cuda, needs_triton, random_rows, rows_view

if DEVICE is not None:
    from megatron_trace.kernels import kv_attention_combine, kv_attention_debug, kv_attention_triton


def _case(seed, b=3, hq=8, hkv=2, t=21, d=32, fmt="nvfp4"):
    g = torch.Generator().manual_seed(seed)
    quant = Quantizer(fmt, per_row=fmt == "nvfp4")
    k = quant.quantize(torch.randn(b, hkv, t, d, generator=g))
    v = quant.quantize(torch.randn(b, hkv, t, d, generator=g))
    return torch.randn(b, hq, d, generator=g), k, v


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reference_is_sdpa_on_bf16_dequantized_kv(fmt):
    q, k, v = _case(0, fmt=fmt)
    kd = k.dequantize(torch.bfloat16).float().repeat_interleave(4, 1)  # GQA: 4 query heads per KV head
    vd = v.dequantize(torch.bfloat16).float().repeat_interleave(4, 1)
    want = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd).squeeze(2)
    assert torch.allclose(reference_attention(q, k, v), want, atol=1e-5)
    assert torch.equal(fp4kv_decode_attention(q, k, v), reference_attention(q, k, v))  # auto -> reference on CPU


def test_lengths_mask_each_sequence_tail():
    q, k, v = _case(1)
    lengths = torch.tensor([21, 4, 1])
    got = reference_attention(q, k, v, lengths=lengths)
    for i, n in enumerate(lengths.tolist()):
        ki = k.dequantize(torch.bfloat16)[i : i + 1, :, :n].float().repeat_interleave(4, 1)
        vi = v.dequantize(torch.bfloat16)[i : i + 1, :, :n].float().repeat_interleave(4, 1)
        want = F.scaled_dot_product_attention(q[i : i + 1].unsqueeze(2), ki, vi).squeeze(2)
        assert torch.allclose(got[i : i + 1], want, atol=1e-5)


@pytest.mark.parametrize("bad,match", [("hq", "multiple of Hkv"), ("d", "does not fit"), ("len", "lengths"),
                                       ("kernel", "kernel='triton' cannot run"),
                                       ("mask", r"kv_mask must be bool or uint8 \(.*got torch.float32"),
                                       ("narrow_mask", r"kv_mask must be \[B=3, >= T=21\], got \(3, 1\)"),
                                       ("block", "head_dim=16 must be a multiple of the mxfp4 block 32"),
                                       ("float_len", "lengths must be an integer tensor, got torch.float32")])
def test_bad_arguments_are_named(bad, match):
    """A float kv_mask (an additive mask's 0 / -inf) was taken as non-zero: attended by the reference (its -inf rows
    attended, its 0 rows not) and cast to bytes by the Triton path (0.5 -> 0: not attended). A [B, 1] mask would
    broadcast over T in the reference; a head_dim below the block has no whole block for the kernels. Float
    lengths were taken: 4.5 attended 5 rows in the reference and 4 in the Triton path (its int32 cast)."""
    q, k, v = _case(2, fmt="mxfp4", d=16) if bad == "block" else _case(2)
    lengths, kernel, mask = None, "auto", None
    if bad == "narrow_mask":
        mask = torch.ones(3, 1, dtype=torch.bool)
    elif bad == "mask":
        mask = torch.zeros(3, 21)
        mask[:, :5] = float("-inf")
    elif bad == "hq":
        q = q[:, :7]
    elif bad == "d":
        q = q[..., :16]
    elif bad == "len":
        lengths = torch.tensor([1, 2])
    elif bad == "float_len":
        lengths = torch.tensor([21.0, 4.5, 1.0])
    elif bad == "kernel":
        kernel = "triton"
    with pytest.raises(ValueError, match=match):
        fp4kv_decode_attention(q, k, v, lengths=lengths, kv_mask=mask, kernel=kernel)



@pytest.mark.parametrize("dense", [False, True], ids=["fp4", "dense"])
@pytest.mark.parametrize("arg,value,match", [
    ("scale", True, "scale=True must be a finite real > 0"), ("scale", float("nan"), "scale=nan must be"),
    ("scale", float("inf"), "scale=inf must be"), ("scale", 0.0, "scale=0.0 must be"),
    ("scale", -0.5, "scale=-0.5 must be"), ("scale", "0.1", "scale='0.1' must be"),
    ("readable_rows", 5, "readable_rows=5 must be >= the K/V length T=21"),
    ("readable_rows", 32.5, "readable_rows=32.5 must be an int >= the K/V length T=21"),
    ("readable_rows", True, "readable_rows=True must be an int"),
    ("q", torch.int64, "q must be a floating-point tensor, got torch.int64"),
    ("lengths", [21, 4, 1], "lengths must be an integer tensor \\[B=3\\] or None, got list"),
    ("kv_mask", [[True] * 21] * 3, "kv_mask must be a bool or uint8 tensor"),
    ("head_dim", 0, "head_dim=0 must be a power of two")])
def test_bad_scalars_and_types_are_named(dense, arg, value, match):
    """Before: scale=True attended with scale 1.0, NaN / Inf gave NaN outputs, 0 or less a uniform (or inverted)
    softmax, readable_rows below T or not an int went unchecked on the reference path, all silently; an int q gave
    an int (truncated) result; a list of lengths or a kv_mask list raised AttributeError, head_dim 0
    ZeroDivisionError."""
    if arg == "head_dim" and not dense:
        pytest.skip("an FP4 K/V of head_dim 0 has no block")
    q, k, v = _case(3)
    if dense:
        k, v = k.dequantize(torch.float32), v.dequantize(torch.float32)
    if arg == "head_dim":
        q, k, v = q[..., :0], k[..., :0], v[..., :0]
    kw = {}
    if arg == "q":
        q, k, v = (q.to(value), k.to(value), v.to(value)) if dense else (q.to(value), k, v)
    elif arg != "head_dim":
        kw[arg] = value
    attend = dense_decode_attention if dense else fp4kv_decode_attention
    with pytest.raises((ValueError, TypeError), match=match):
        attend(q, k, v, **kw)


def test_exact_must_be_a_bool():
    """exact="no" is truthy: the Triton path ran its exact kernel."""
    q, k, v = _case(3)
    with pytest.raises(ValueError, match="exact='no' must be a bool"):
        fp4kv_decode_attention(q, k, v, exact="no")

# --- the Triton kernels (CUDA, or Triton's CPU interpreter with TRITON_INTERPRET=1: small shapes) -------------

QUANTIZERS = {"nvfp4_row": ("nvfp4", True), "nvfp4_tensor": ("nvfp4", False), "mxfp4": ("mxfp4", False)}


def _kv_case(name, b, hq, hkv, t, d, seed=0, spread=3):
    """q bf16 [B, Hq, D] and FP4 k, v [B, Hkv, T, D] on DEVICE; K rows scaled by 2**[-spread, spread)."""
    fmt, per_row = QUANTIZERS[name]
    g = torch.Generator().manual_seed(seed)
    quant = Quantizer(fmt, per_row=per_row)
    mag = torch.exp2(torch.randint(-spread, spread, (b, hkv, t, 1), generator=g).float())
    k = quant.quantize((torch.randn(b, hkv, t, d, generator=g) * mag).to(DEVICE))
    v = quant.quantize(torch.randn(b, hkv, t, d, generator=g).to(DEVICE))
    return torch.randn(b, hq, d, generator=g).to(torch.bfloat16).to(DEVICE), k, v


def _rel(a, b):
    """Relative L2 error of ``a`` against ``b``, both divided by b's amax first (tiny outputs: no underflow)."""
    m = b.float().abs().amax()
    m = torch.where(m > 0, m, 1.0)
    return float(((a.float() - b.float()) / m).norm() / (b.float() / m).norm())


TIGHT = 2e-3 if INTERPRET else 5e-3
"""Relative error bound against the reference over the kernel's own K/V values: the interpreter's fp32 dots
round only the output to bf16; on the GPU the MMAs also take the softmax weights in bf16 (2**-9 each): 2.2e-3
to 3.4e-3 on the H200 (2026-12-01)."""


def _check(got, q, k, v, exact=False, **kw):
    """Within bf16 rounding (``TIGHT``) of the reference over the kernel's K/V values (fp32: the exact FP4 values
    for the fast path; bf16 for the exact one), and within 1e-2 of the other (moderate scores)."""
    assert got.dtype == q.dtype and got.shape == q.shape and torch.isfinite(got).all()
    scale = q.shape[-1] ** -0.5
    tight, loose = (torch.bfloat16, torch.float32) if exact else (torch.float32, torch.bfloat16)
    assert _rel(got, reference_attention(q, k, v, scale=scale, kv_dtype=tight, **kw)) < TIGHT
    assert _rel(got, reference_attention(q, k, v, scale=scale, kv_dtype=loose, **kw)) < 1e-2


@needs_triton
@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_fast_path_dequantization_is_value_times_scale(name, d):
    """The fast kernel's in-register K/V operand is exactly code value x block scale x 2**-62 (bf16 bits)."""
    fmt, per_row = QUANTIZERS[name]
    x = random_rows((37, d), torch.float32, torch.Generator().manual_seed(d), spread=3.0)  # many scale regimes
    t = Quantizer(fmt, per_row=per_row).quantize(x.to(DEVICE))
    got = kv_attention_debug.dequantize_groups(t, block_t=16)
    want = kv_attention_debug.groups_reference(t).cpu()
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


@needs_triton
@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("d", [64, 128])
def test_fast_path_dequantization_of_tiny_and_zero_block_scales(name, d):
    """Blocks 2**0 .. 2**-23 below the row's largest: NVFP4 block scales down to e4m3 subnormals and zero (the
    uint16-pair scale conversion on the GPU, byte-wise in the interpreter), still exactly value x scale x 2**-62."""
    fmt, per_row = QUANTIZERS[name]
    g = torch.Generator().manual_seed(d + 1)
    bs = 16 if fmt == "nvfp4" else 32
    mag = torch.exp2(-torch.randint(0, 24, (41, d // bs, 1), generator=g).float())
    mag[:, 0] = 1.0  # each row's amax in its first block
    x = (torch.randn(41, d // bs, bs, generator=g) * mag).reshape(41, d)
    t = Quantizer(fmt, per_row=per_row).quantize(x.to(DEVICE))
    sc = t.block_scales.view(torch.uint8).cpu()
    if fmt == "nvfp4":
        assert ((sc > 0) & (sc < 8)).any() and (sc == 0).any()  # e4m3 subnormal and zero scales occur
    got = kv_attention_debug.dequantize_groups(t, block_t=32)
    want = kv_attention_debug.groups_reference(t).cpu()
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


@needs_triton
@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("b,hq,hkv,t,d,block_t,splits", [
    (2, 8, 2, 37, 32, 16, 3),  # odd T, several splits, a partial last tile
    (1, 4, 4, 5, 64, 16, None),  # T < BT, one query head per KV head
    (2, 16, 2, 21, 128, 16, 2),  # G = 8
    (1, 2, 1, 19, 256, 32, 1),
])
def test_fast_path_matches_reference(name, b, hq, hkv, t, d, block_t, splits):
    q, k, v = _kv_case(name, b, hq, hkv, t, d, seed=t)
    if DEVICE == "cuda" and k.fmt == "mxfp4" and block_t < kv_attention_triton.MXFP4_MIN_BLOCK_T and d == 32:
        with pytest.raises(ValueError, match=f"block_t={block_t} with MXFP4"):  # byte-wise scales: refused (see there)
            kv_attention_triton.decode_attention(q, k, v, scale=d**-0.5, exact=False, block_t=block_t)
        return
    got = kv_attention_triton.decode_attention(q, k, v, scale=d**-0.5, exact=False, block_t=block_t, splits=splits)
    _check(got, q, k, v)


@needs_triton
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_exact_path_dequantization_is_the_reference_bf16(name):
    """The exact kernel's in-register K/V rows (``_deq_rows``) are ``FP4Tensor.dequantize(torch.bfloat16)``, bit for
    bit, in each format (NVFP4 per row or per tensor: the S_enc division; MXFP4: the E8M0 exponents)."""
    fmt, per_row = QUANTIZERS[name]
    x = random_rows((37, 64), torch.float32, torch.Generator().manual_seed(3), spread=3.0)
    t = Quantizer(fmt, per_row=per_row).quantize(x.to(DEVICE))
    got = kv_attention_debug.dequantize_rows(t, block_t=16)
    assert torch.equal(got.cpu().view(torch.int16), t.dequantize(torch.bfloat16).cpu().view(torch.int16))


@needs_triton
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_exact_path_matches_reference(name):
    """The exact kernel in each format (the other exact-path tests take NVFP4 per row), G = 4, one split of two
    tiles, the second partial; K's codes and block scales as views with a strided last dim (copied for the kernel)."""
    q, k, v = _kv_case(name, 2, 8, 2, 45, 32, seed=4)
    k = dataclasses.replace(k, **{f: getattr(k, f).transpose(-1, -2).contiguous().transpose(-1, -2)
                                  for f in ("codes", "block_scales")})
    assert k.codes.stride(-1) == 45  # (and the scales but for MXFP4's single block)
    got = kv_attention_triton.decode_attention(q, k, v, scale=32**-0.5, exact=True, block_t=32, splits=1)
    _check(got, q, k, v, exact=True)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's fp32 dots (the GPU's MMAs round the weights to bf16)")
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_fast_path_in_fp32_is_the_fp32_reference(name):
    """Under the interpreter the fast path's dots are fp32 and its K/V the exact FP4 values: with q of bf16 values
    given in fp32 (the kernel loads q as bf16) the fp32 result equals the fp32-K/V reference within fp32 rounding,
    far below ``TIGHT`` (the bf16 output's rounding, which hides errors of 1e-4). Lengths, starts and a uint8 kv_mask
    (2: attended) with a hole, G = 4, two splits of two tiles each (the second split's last tile partial); q a view
    with a strided last dim (copied for the kernel)."""
    q, k, v = _kv_case(name, 3, 8, 2, 61, 64, seed=11)
    q = torch.stack([q.float(), torch.full_like(q.float(), float("nan"))], -1)[..., 0]  # q.stride(-1) == 2
    assert q.stride(-1) == 2
    kw = dict(lengths=torch.tensor([61, 40, 9]), starts=torch.tensor([0, 7, 3]),
              kv_mask=((torch.arange(61) % 11 != 4) * 2).to(torch.uint8).expand(3, 61))
    got = kv_attention_triton.decode_attention(q, k, v, scale=0.125, exact=False, block_t=16, splits=2, **kw)
    assert got.dtype == torch.float32
    assert _rel(got, reference_attention(q, k, v, scale=0.125, kv_dtype=torch.float32, **kw)) < 1e-5


@needs_triton
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("name", ["nvfp4_row", "nvfp4_tensor"])
def test_saturated_encode_scale(name, exact):
    """K and V amaxes below 2688 / FLT_MAX (some K rows, every V row): S_enc saturates at FLT_MAX, and both paths
    give the reference's result (the fast path's per-row factor takes the amax at least 2688 / FLT_MAX; with
    amax * 2**62 / 2688 the output would be 2688 / (amax * FLT_MAX) times too small)."""
    fmt, per_row = QUANTIZERS[name]
    g = torch.Generator().manual_seed(9)
    quant = Quantizer(fmt, per_row=per_row)
    kx = torch.randn(2, 2, 5, 64, generator=g)
    kx[:, :, ::2] *= 1e-37  # tiny K rows: scores ~0 next to the others' (per tensor: K's amax stays normal)
    k = quant.quantize(kx.to(DEVICE))
    v = quant.quantize((torch.randn(2, 2, 5, 64, generator=g) * 1.5e-36).to(DEVICE))  # weighted sums stay normal
    assert float(v.global_amax.max()) < 7.9e-36
    q = torch.randn(2, 8, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    got = kv_attention_triton.decode_attention(q, k, v, scale=0.125, exact=exact, block_t=16)
    for kv_dtype in (torch.float32, torch.bfloat16):  # this 5-token case is 2.5e-3 off at any V scale (bf16 output)
        want = reference_attention(q, k, v, scale=0.125, kv_dtype=kv_dtype)
        assert want.abs().amax(-1).min() > 0 and _rel(got, want) < 5e-3, _rel(got, want)


@needs_triton
@pytest.mark.parametrize("exact", [False, True])
def test_running_max_across_growing_scores(exact):
    """The online softmax over tiles whose maxima climb by about 5, 15 and 2 (log2 units) within one split (the
    accumulators and the sum rescaled at each) gives the reference's result over the kernel's K/V values (fp32
    for the fast path, bf16 for the exact one) within bf16 rounding. (Dropping the sum's rescale failed only this
    test in this file, 2026-12-04.)"""
    d, bt, log2e = 64, 16, 1.4426950408889634
    g = torch.Generator().manual_seed(5)
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    top = torch.tensor([1.0, 6.0, 21.0, 23.0]).repeat_interleave(bt)  # head 0's tile maxima, log2 units
    a = top * (0.5 + 0.5 * torch.arange(4 * bt).remainder(bt) / (bt - 1)) / log2e
    kx = a[:, None] * u[None, :] + 0.05 * torch.randn(4 * bt, d, generator=g)
    q = (8.0 * u[None, :] * torch.tensor([1.0, 0.5, -0.25, 0.75])[:, None]).to(torch.bfloat16)[None]  # [1, 4, D]
    quant = Quantizer("nvfp4", per_row=True)
    k = quant.quantize(kx[None, None].to(DEVICE))
    v = quant.quantize(torch.randn(1, 1, 4 * bt, d, generator=g).to(DEVICE))
    s = (k.dequantize(torch.float32)[0, 0].cpu() @ q[0, 0].float()) * d**-0.5 * log2e
    grow = s.reshape(4, bt).amax(1).diff()
    assert (grow > 8).any() and ((grow > 0) & (grow <= 8)).any()  # both kinds of tile occur
    got = kv_attention_triton.decode_attention(q.to(DEVICE), k, v, scale=d**-0.5, exact=exact, block_t=bt, splits=1)
    assert torch.isfinite(got).all()
    kv_dtype = torch.bfloat16 if exact else torch.float32
    bound = 5e-3 if exact else TIGHT  # (the exact kernel rounds the softmax weights to bf16 in the interpreter too)
    assert _rel(got, reference_attention(q.to(DEVICE), k, v, scale=d**-0.5, kv_dtype=kv_dtype)) < bound


@needs_triton
@pytest.mark.parametrize("t_len,width", [(40, 45), (41, 45), (40, 48)], ids=["t40", "t41", "t40_viewed"])
@pytest.mark.parametrize("words", [True, False], ids=["mask_words", "mask_bytes"])
@pytest.mark.parametrize("exact", [False, True])
def test_lengths_and_left_padding_masks(exact, words, t_len, width, monkeypatch):
    """Masks as int32 words: copied and padded (width 45: rows not 4-byte aligned; t41: a partial last word) or
    viewed in place (width 48); and as bytes."""
    from megatron_trace.kernels import kv_attention_plan

    monkeypatch.setattr(kv_attention_plan, "MASK_AS_WORDS", words)
    q, k, v = _kv_case("nvfp4_row", 3, 8, 2, t_len, 64, seed=5)
    lengths = torch.tensor([1, 17, t_len], device=DEVICE)  # one token; a split boundary; all
    got = kv_attention_triton.decode_attention(q, k, v, scale=64**-0.5, lengths=lengths, exact=exact, block_t=16,
                                               splits=3)
    _check(got, q, k, v, exact, lengths=lengths)
    mask = torch.ones(3, width, dtype=torch.bool, device=DEVICE)  # [B, >= T]
    mask[0, :39] = False  # left padding down to one token
    mask[1, :20] = False  # left padding over a whole split
    mask[2, ::3] = False
    got = kv_attention_triton.decode_attention(q, k, v, scale=64**-0.5, kv_mask=mask, exact=exact, block_t=16,
                                               splits=3)
    _check(got, q, k, v, exact, kv_mask=mask)


@needs_triton
@pytest.mark.parametrize("exact", [False, True])
def test_lengths_past_the_history_attend_the_whole_history(exact):
    """A length > T attends the T rows (as the reference's mask does), never the rows past T of the storage."""
    q, k, v = _kv_case("nvfp4_row", 2, 8, 2, 24, 64, seed=9)
    lengths = torch.tensor([24, 28], device=DEVICE)
    got = kv_attention_triton.decode_attention(q, k, v, scale=64**-0.5, lengths=lengths, exact=exact, block_t=16,
                                               splits=2)
    _check(got, q, k, v, exact, lengths=torch.tensor([24, 24], device=DEVICE))


@needs_cuda
def test_an_empty_history_gives_the_references_zeros():
    q, k, v = _case(4, t=0)
    q, k, v = q.to("cuda"), *(dataclasses.replace(t, **{f: getattr(t, f).to("cuda") for f in
                                                        ("codes", "block_scales", "global_amax")}) for t in (k, v))
    want = reference_attention(q, k, v)
    assert torch.equal(fp4kv_decode_attention(q, k, v, kernel="triton"), want)
    kd, vd = k.dequantize(q.dtype), v.dequantize(q.dtype)
    from megatron_trace.kernels.kv_attention import dense_decode_attention

    assert torch.equal(dense_decode_attention(q, kd, vd, kernel="triton"), dense_decode_attention(q, kd, vd))


def test_k_and_v_of_different_formats_are_refused():
    q, k, _ = _case(3, fmt="nvfp4")
    _, _, v = _case(3, fmt="mxfp4")
    for kernel in ("reference", "auto"):
        with pytest.raises(ValueError, match=r"k \(nvfp4\) and v \(mxfp4\) must share one FP4 format"):
            fp4kv_decode_attention(q, k, v, kernel=kernel)


def _interval_rows(t_len, device):
    """(starts, ends, the same as a mask) over 5 rows: a start inside a tile, past a whole split, one token,
    a finished row's tail, everything."""
    starts = torch.tensor([5, 23, t_len - 1, 0, 0], device=device)
    ends = torch.tensor([t_len, t_len, t_len, 13, t_len], device=device)
    pos = torch.arange(t_len, device=device)
    return starts, ends, (pos >= starts[:, None]) & (pos < ends[:, None])


def test_reference_starts_are_the_left_padding_mask():
    q, k, v = _case(6, b=5, t=41)
    starts, ends, mask = _interval_rows(41, "cpu")
    assert torch.equal(reference_attention(q, k, v, starts=starts, lengths=ends),
                       reference_attention(q, k, v, kv_mask=mask))
    with pytest.raises(ValueError, match=r"starts must be \[B=5\]"):
        reference_attention(q, k, v, starts=starts[:2])


@needs_triton
@pytest.mark.parametrize("t_len,splits", [(40, 3), (41, 2)])
@pytest.mark.parametrize("exact", [False, True])
def test_intervals_give_the_masks_result_bit_for_bit(exact, t_len, splits):
    """starts / lengths (no mask loads, the tiles before a row's start not run) == the same rows as a kv_mask:
    the tiles that run see the same tokens (boundaries stay multiples of BT), skipped ones attend nothing. Splits
    of one tile (T = 40) and of two (41: tiles starting at a row's start instead would regroup the online softmax)."""
    q, k, v = _kv_case("nvfp4_row", 5, 8, 2, t_len, 64, seed=7)
    starts, ends, mask = _interval_rows(t_len, DEVICE)
    kw = dict(scale=64**-0.5, exact=exact, block_t=16, splits=splits)
    got = kv_attention_triton.decode_attention(q, k, v, starts=starts, lengths=ends, **kw)
    assert torch.equal(got, kv_attention_triton.decode_attention(q, k, v, kv_mask=mask, **kw))
    _check(got, q, k, v, exact, kv_mask=mask)


@needs_triton
@pytest.mark.parametrize("t", [1, 37, 1500])
def test_mask_intervals_kernel_is_the_reference(t):
    """One launch: first / end per row and the rows with a hole counted, on a strided 4D-mask view."""
    from megatron_trace.kernels import kv_intervals, kv_intervals_triton

    g = torch.Generator().manual_seed(t)
    b = 6
    lo = torch.randint(0, t, (b,), generator=g)
    hi = torch.minimum(lo + torch.randint(1, t + 1, (b,), generator=g), torch.tensor(t))
    pos = torch.arange(t + 3)
    m = (pos >= lo[:, None]) & (pos < hi[:, None])
    m[1] = False  # attends nothing: (T, 0)
    if t > 2:
        m[2], m[2, 0], m[2, t - 1] = False, True, True  # two runs: a hole
    m[[0, 1, 2], t:] = True  # columns past T attend: ignored (row 1 still attends nothing)
    four_d = torch.zeros(b, 1, 2, t + 3, dtype=torch.bool)
    four_d[:, 0, -1] = m
    view = four_d.to(DEVICE)[:, 0, -1, :]  # row stride 2 * (t + 3)
    want_holes, got_holes = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    want = kv_intervals.intervals_reference(m, t, want_holes)
    got = kv_intervals_triton.mask_intervals(view, t, got_holes)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(got, want)) and torch.equal(got_holes.cpu(), want_holes)
    assert want[0][1] == t and want[1][1] == 0
    assert int(want_holes) == (1 if t > 2 else 0)
    first, end = want
    fill = (pos[:t] >= first[:, None]) & (pos[:t] < end[:, None])
    assert torch.equal(fill[[0, 3, 4, 5]], m[[0, 3, 4, 5], :t])  # no hole: the interval is the mask


def test_aligned_rows_round_up_to_16_within_the_readable_rows():
    from megatron_trace.kernels.kv_attention import aligned_rows

    assert [aligned_rows(41, r) for r in (None, 41, 47, 48, 300)] == [41, 41, 41, 48, 48]
    assert aligned_rows(48, 48) == 48
    with pytest.raises(ValueError, match="readable_rows=40 must be >= the K/V length T=41"):
        aligned_rows(41, 40)


@needs_triton
@pytest.mark.parametrize("rows", ["none", "lengths", "mask", "interval"])
@pytest.mark.parametrize("exact", [False, True])
def test_readable_rows_change_nothing_but_the_load_bound(exact, rows):
    """readable_rows: the loads run to T rounded up to 16 (rows [T, 48) read, weigh 0), bit for bit the result
    without it; rows past 48 are never read (NaN there changes nothing)."""
    q, k, v = _kv_case("nvfp4_row", 5, 8, 2, 60, 64, seed=9)
    for full in (k, v):  # rows [41, 48) finite garbage, [48, 60) NaN
        full.codes[:, :, 41:48] = 0x77
        full.global_amax[:, :, 48:] = float("nan")
    kt_, vt = rows_view(k, 41), rows_view(v, 41)
    starts, ends, mask = _interval_rows(41, DEVICE)
    kw = {"none": {}, "lengths": {"lengths": ends}, "mask": {"kv_mask": mask},
          "interval": {"starts": starts, "lengths": ends}}[rows]
    run = dict(scale=64**-0.5, exact=exact, block_t=16, splits=3, **kw)
    want = kv_attention_triton.decode_attention(q, kt_, vt, **run)
    got = kv_attention_triton.decode_attention(q, kt_, vt, readable_rows=60, **run)
    assert torch.equal(got, want) and torch.isfinite(got).all()


@needs_triton
def test_fast_path_reads_fp4_kv_cache_views_and_odd_offsets():
    """``FP4KVCache`` history (a strided view of the capacity buffers) goes in as is; codes at an odd byte
    offset (no uint16 view) are copied."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.kv_cache import FP4KVCache

    g = torch.Generator().manual_seed(9)
    cache = FP4KVCache(1, TraceConfig().activation_quantizer())
    k0 = torch.randn(2, 2, 20, 64, generator=g).to(DEVICE)
    cache.update(k0, -k0, 0)
    for _ in range(3):
        step = torch.randn(2, 2, 1, 64, generator=g).to(DEVICE)
        cache.update(step, step * 0.5, 0)
    layer = cache.layers[0]
    kq, vq = layer.fp4_history("kv_k"), layer.fp4_history("kv_v")
    assert kq.codes.stride(2) == 32 and not kq.codes.is_contiguous()
    q = torch.randn(2, 8, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    got = kv_attention_triton.decode_attention(q, kq, vq, scale=0.125, exact=False, block_t=16)
    _check(got, q, kq, vq)
    buf = torch.zeros(vq.codes.numel() + 1, dtype=torch.uint8, device=DEVICE)
    buf[1:] = vq.codes.flatten()
    odd = dataclasses.replace(vq, codes=buf[1:].view(vq.codes.shape))  # storage offset 1
    assert torch.equal(kv_attention_triton.decode_attention(q, kq, odd, scale=0.125, exact=False, block_t=16), got)


@pytest.mark.parametrize("pairs,n_tiles,slots", [(32, 64, 396), (256, 64, 396), (32, 256, 396), (4, 8, 396),
                                                 (1, 1, 8), (300, 7, 396), (64, 1000, 264), (4, 256, 2112),
                                                 (256, 3, 396)])
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (host-side launch planning only)")
def test_fast_splits_leave_no_split_empty_and_fill_waves(pairs, n_tiles, slots):
    """Every split the fast path launches has tiles, and no other split count up to ``MAX_FAST_SPLITS`` finishes
    in fewer tile times (waves x (tiles per split + 1)), checked against all counts 1..min(n_tiles, the cap)."""
    from megatron_trace.kernels.kv_attention_plan import MAX_FAST_SPLITS, fast_splits

    s = fast_splits(pairs, n_tiles, slots)
    per = -(-n_tiles // s)
    assert 1 <= s <= min(n_tiles, MAX_FAST_SPLITS) and (s - 1) * per < n_tiles  # the last starts inside T

    def cost(k):
        p = -(-n_tiles // k)
        return -(-pairs * -(-n_tiles // p) // slots) * (p + 1)

    assert cost(s) == min(cost(k) for k in range(1, min(n_tiles, MAX_FAST_SPLITS) + 1))
    assert all(cost(k) > cost(s) for k in range(1, s))  # ties: the fewest splits (256-3-396: 1 and 3 take 4)
    if (pairs, n_tiles, slots) == (32, 64, 396):  # batch 8, 4 KV heads, 8K at 128 tokens, H200 x 3 programs
        assert (s, per) == (11, 6)


@needs_triton
@pytest.mark.parametrize("splits, per_step", [(1, 256), (3, 256), (17, 256), (100, 256), (100, 32), (17, 4)])
def test_combine_kernel_is_the_torch_combine(splits, per_step, monkeypatch):
    """The one-launch merge of split partials equals the torch ops (fp32 sums in another order), including
    empty splits (max -inf) and a row whose splits are all empty (0/0: NaN, as torch gives), in one step or in
    several (``COMBINE_SPLITS_PER_STEP``)."""
    monkeypatch.setattr(kv_attention_combine, "COMBINE_SPLITS_PER_STEP", per_step)
    g = torch.Generator().manual_seed(splits)
    acc = torch.randn(2, 3, splits, 64, generator=g) * 4
    ml = torch.stack([torch.randn(2, 3, splits, generator=g) * 3, torch.rand(2, 3, splits, generator=g) + 0.5], -1)
    ml[0, 1, 0, 0] = float("-inf")
    acc[0, 1, 0] = 0.0
    ml[1, 2, :, 0] = float("-inf")
    acc[1, 2] = 0.0
    want = kv_attention_combine.combine(acc, ml)
    got = kv_attention_combine.combine_splits(acc.to(DEVICE), ml.to(DEVICE), torch.float32).cpu()
    assert torch.isnan(got[1, 2]).all() and torch.isnan(want[1, 2]).all()
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=2e-6, atol=1e-6)
    bf = kv_attention_combine.combine_splits(acc.to(DEVICE), ml.to(DEVICE), torch.bfloat16).cpu()
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf[ok].float(), want[ok], rtol=8e-3, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("shift", [-300.0, 300.0])
def test_combine_kernel_takes_split_maxima_far_from_zero(shift):
    """Split maxima near -300 or 300 (units of e; exp of either over- or underflows fp32): each split weighs
    exp(m - the row's max), so a shift common to a row's maxima changes nothing, bit for bit (maxima multiples of
    2**-10: exact when shifted). One split empty (-inf), one row all empty (NaN, as torch gives)."""
    g = torch.Generator().manual_seed(3)
    acc = torch.randn(2, 3, 5, 64, generator=g)
    m = torch.round(torch.randn(2, 3, 5, generator=g) * 3 * 1024) / 1024
    ml = torch.stack([m, torch.rand(2, 3, 5, generator=g) + 0.5], -1)
    ml[0, 1, 2, 0] = float("-inf")
    ml[1, 2, :, 0] = float("-inf")
    want = kv_attention_combine.combine_splits(acc.to(DEVICE), ml.to(DEVICE), torch.float32).cpu()
    shifted = ml.clone()
    shifted[..., 0] += shift
    got = kv_attention_combine.combine_splits(acc.to(DEVICE), shifted.to(DEVICE), torch.float32).cpu()
    assert torch.isfinite(want[:1]).all() and torch.isfinite(want[1, :2]).all() and torch.isnan(got[1, 2]).all()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(kv_attention_combine.combine(acc, shifted).view(torch.int32),
                       kv_attention_combine.combine(acc, ml).view(torch.int32))


@pytest.mark.parametrize("case", ["viewed", "narrow", "odd_stride", "odd_offset", "uint8", "int64", "t_mult4"])
def test_mask_arg_words_hold_the_masks_first_t_bytes(case):
    """kv_mask [B, >= T] -> int32 words [B, ceil(T / 4)] whose first T bytes are the mask's (non-zero: attended):
    viewed where the bytes already lie as words, else copied (a row narrower than T rounded up to 4, a row stride
    or offset not divisible by 4, a mask of wider elements)."""
    from megatron_trace.kernels.kv_attention_plan import mask_arg

    g = torch.Generator().manual_seed(1)
    t = 40 if case == "t_mult4" else 41
    base = torch.rand(3, 48, generator=g) > 0.4
    m = {"viewed": base, "narrow": base[:, :42], "odd_stride": torch.rand(3, 45, generator=g) > 0.4,
         "odd_offset": (torch.rand(3 * 48 + 1, generator=g) > 0.4)[1:].view(3, 48), "uint8": base.to(torch.uint8),
         "int64": base.to(torch.int64), "t_mult4": base[:, :40]}[case]
    words, as_words = mask_arg(m, t, "cpu")
    assert as_words and words.dtype == torch.int32 and words.shape == (3, -(-t // 4))
    assert torch.equal(words.view(torch.uint8)[:, :t] != 0, m[:, :t] != 0)
    assert (words.data_ptr() == m.data_ptr()) == (case in ("viewed", "uint8", "t_mult4"))


def test_mask_intervals_take_exactly_t_columns_and_name_a_bad_mask():
    from megatron_trace.kernels.kv_intervals import mask_intervals

    m = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.uint8)
    holes = torch.zeros(1, dtype=torch.int32)
    first, end = mask_intervals(m, 4, holes)
    assert first.tolist() == [1, 0, 4, 0] and end.tolist() == [3, 4, 0, 3] and holes.tolist() == [1]
    for bad in (m.float(), m.to(torch.int32), m[:, :3], m[:, None].expand(4, 4, 4)):
        with pytest.raises(ValueError, match=r"mask must be bool or uint8 \[B, >= T=4\], got"):
            mask_intervals(bad, 4)


def test_scale_word_loads_only_whole_rows_at_aligned_addresses():
    """The fast path's scale loads (MXFP4 here: no inline PTX needed): words of 4 or 2 bytes only where every row's
    blocks fill whole words and each row starts at such an address; bytes otherwise (a word would take the next
    row's or another column's scales)."""
    from megatron_trace.kernels.kv_attention_plan import scale_word

    buf = torch.zeros(2, 3, 5, 8, dtype=torch.uint8)
    assert scale_word(False, "mxfp4", 256, 32, buf) == 4  # 8 blocks a row
    assert scale_word(False, "mxfp4", 128, 32, buf[..., :4]) == 4  # row stride 8
    assert scale_word(False, "mxfp4", 64, 32, buf[..., :2]) == 2  # 2 blocks a row (in rows of 8 bytes)
    assert scale_word(False, "mxfp4", 32, 32, buf[..., :1]) == 1
    assert scale_word(False, "mxfp4", 128, 32, buf[..., 2:6]) == 2  # rows start at byte 2 (mod 4)
    assert scale_word(False, "mxfp4", 128, 32, buf.flatten()[: 2 * 3 * 5 * 5].view(2, 3, 5, 5)[..., :4]) == 1
    assert scale_word(False, "mxfp4", 128, 32, buf, buf.flatten()[1:121].view(2, 3, 5, 4)) == 1  # odd base
    assert scale_word(False, "nvfp4", 128, 16, buf) == 1  # NVFP4 word loads: only with the GPU's inline PTX
    assert scale_word(True, "nvfp4", 128, 16, buf) == 4


if DEVICE is not None:
    import triton
    import triton.language as tl

    from megatron_trace.kernels.kv_attention_loop import _program

    @triton.jit
    def _program_kernel(len_ptr, first_ptr, out_ptr, T, R, chunk, n_tiles, HKV: tl.constexpr, BT: tl.constexpr,
                        HAS_LEN: tl.constexpr, HAS_FIRST: tl.constexpr, LOAD_R: tl.constexpr):
        """out[program] = ``_program``'s (b, h, split, start, load_end, end, first, tiles), for checking them."""
        got = _program(len_ptr, first_ptr, T, R, chunk, n_tiles, HKV, BT, HAS_LEN, HAS_FIRST, LOAD_R)
        out = out_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 8
        for j in tl.static_range(8):
            tl.store(out + j, got[j] + tl.zeros([], tl.int64))


@needs_triton
@pytest.mark.parametrize("has_len,has_first,load_r", [(False, False, False), (True, False, False),
                                                       (False, True, False), (True, True, False), (True, True, True)])
def test_program_runs_exactly_the_tiles_that_attend_something(has_len, has_first, load_r):
    """Each program's tiles (the trip count the compiled kernels loop over; the interpreter runs all ``chunk / BT``
    tiles of a split, so only this launch sees it): with lengths or starts, exactly the split's tiles (boundaries
    multiples of BT) that hold an attended row of [first, min(length, T)), a partial last tile included; without,
    all of the split's tiles. The loads end at the attend end, or with readable rows at the split's end or R."""
    t_len, rows, bt, chunk, splits, hkv = 75, 80, 16, 32, 3, 2
    lengths = torch.tensor([75, 40, 17, 1, 90, 0, 64, 33], dtype=torch.int32)  # a partial tile, a length past T
    firsts = torch.tensor([0, 5, 16, 0, 47, 75, 63, 33], dtype=torch.int32)  # inside a tile, on a boundary, (T, 0)
    bsz = lengths.numel()
    out = torch.full((bsz * hkv, splits, 8), -7, dtype=torch.int64, device=DEVICE)
    _program_kernel[(bsz * hkv, splits)](lengths.to(DEVICE), firsts.to(DEVICE), out, t_len, rows, chunk, chunk // bt,
                                         HKV=hkv, BT=bt, HAS_LEN=has_len, HAS_FIRST=has_first, LOAD_R=load_r)
    out = out.cpu()
    for pid in range(bsz * hkv):
        b = pid // hkv
        n = min(int(lengths[b]), t_len) if has_len else t_len
        first = int(firsts[b]) if has_first else 0
        for split in range(splits):
            got_b, got_h, got_split, start, load_end, end, got_first, tiles = out[pid, split].tolist()
            lo = split * chunk
            assert (got_b, got_h, got_split, end, got_first) == (b, pid % hkv, split, min(lo + chunk, n), first)
            assert load_end == (min(lo + chunk, rows) if load_r else end)
            run = [start + i * bt for i in range(max(tiles, 0))]
            tiles_of_split = range(lo, lo + chunk, bt)
            if has_len or has_first:  # the tiles holding a row of [first, end), in order
                want = [s for s in tiles_of_split if s < end and s + bt > first]
            else:
                want = list(tiles_of_split)
            assert run == want, (b, split, run, want)
