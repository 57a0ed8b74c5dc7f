"""SGLang's FP4 KV format reference against an independent brute-force (numpy) computation.

Bit-exactness against SGLang's own ``KVFP4QuantizeUtil`` is in tests/sglang/test_kvfp4_sglang.py.
"""

import dataclasses

import numpy as np
import pytest
import torch

from megatron_trace.formats import FullGuidance, GuidanceMismatchError, NonFiniteError, e2m1, mxfp4
from megatron_trace.formats import sglang_kvfp4 as kv

GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def brute_exponent(amax: np.ndarray) -> np.ndarray:
    """The smallest integer e with amax / 2**e <= 6 (exact), -33 for zero blocks (SGLang's clamp)."""
    out = np.empty(amax.shape, dtype=np.int64)
    for i, a in np.ndenumerate(amax.astype(np.float64)):
        if a / 6 < 1e-10:
            out[i] = -33
            continue
        e = -200
        while a / 2.0**e > 6:
            e += 1
        while e > -200 and a / 2.0 ** (e - 1) <= 6:
            e -= 1
        out[i] = e
    return out


def brute_codes(z: np.ndarray) -> np.ndarray:
    """Nearest grid magnitude by exhaustive search, ties to the LARGER magnitude; sign iff z < 0."""
    a = np.minimum(np.abs(z.astype(np.float64)), 6.0)
    d = np.abs(a[..., None] - GRID)
    best = d.min(-1, keepdims=True)
    idx = np.where(d == best, np.arange(8), -1).max(-1)  # the larger of tied candidates
    return (idx | ((z < 0).astype(np.int64) << 3)).astype(np.uint8)


def _random(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 32, generator=g) * torch.logspace(-4, 4, n).reshape(n, 1, 1)
    x[7] = 0.0  # all-zero token
    x[9, 1, :16] = 0.0  # one all-zero block
    return x


def test_float32_matches_brute_force():
    x = _random()
    q = kv.quantize(x, compute_dtype=torch.float32)
    xb = x.numpy().reshape(x.shape[0], 2, 2, 16)
    e = brute_exponent(np.abs(xb).max(-1))
    assert np.array_equal(q.block_scales.view(torch.uint8).numpy().astype(np.int64), e + 127)
    want = brute_codes(xb / 2.0 ** e[..., None]).reshape(x.shape)
    assert torch.equal(e2m1.unpack(q.codes), torch.from_numpy(want))
    assert q.global_amax is None and q.fmt == "sglang_kvfp4" and q.codes.shape == (x.shape[0], 2, 16)


def test_ties_go_away_from_zero_and_sign_rule():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.cat([mids, -mids, torch.tensor([6.0, -0.0])]).reshape(1, 16)  # amax 6 -> e = 0
    q = kv.quantize(row)
    codes = e2m1.unpack(q.codes)[0]
    assert codes[:7].tolist() == [1, 2, 3, 4, 5, 6, 7]  # RNE would give 0, 2, 2, 4, 4, 6, 6
    assert codes[7:14].tolist() == [9, 10, 11, 12, 13, 14, 15]
    assert codes[14].item() == 7 and codes[15].item() == 0  # -0.0 is not < 0: code 0 (not 8)
    small_neg = kv.quantize(torch.tensor([[6.0, -0.1] + [0.0] * 14]))
    assert e2m1.unpack(small_neg.codes)[0, 1].item() == 8  # rounds to -0
    assert q.block_scales.view(torch.uint8).item() == 127


def test_zero_block_scale_and_dequantize():
    x = _random(seed=1)
    q = kv.quantize(x, compute_dtype=torch.float32)
    assert q.block_scales.view(torch.uint8)[7].unique().tolist() == [94]  # 2**-33, SGLang's clamp of 1e-10
    xb = x.numpy().reshape(x.shape[0], 2, 2, 16)
    e = brute_exponent(np.abs(xb).max(-1))
    vals = np.where(e2m1.unpack(q.codes).numpy() & 8, -1.0, 1.0) * GRID[e2m1.unpack(q.codes).numpy() & 7]
    want = (vals.reshape(xb.shape) * 2.0 ** e[..., None]).reshape(x.shape).astype(np.float32)
    assert torch.equal(kv.dequantize(q, torch.float32), torch.from_numpy(want))
    assert torch.equal(kv.dequantize(q), torch.from_numpy(want).to(torch.bfloat16))


def test_bf16_compute_differs_only_by_exponent_rounding():
    x = (torch.randn(4000, 64) * torch.logspace(-3, 3, 4000).reshape(-1, 1)).to(torch.bfloat16)
    eager = kv.quantize(x)  # SGLang run eagerly on a bf16 cache: bf16 math
    f32 = kv.quantize(x, compute_dtype=torch.float32)  # SGLang compiled (inductor): float32 math
    d = eager.block_scales.view(torch.uint8).int() - f32.block_scales.view(torch.uint8).int()
    assert set(d.unique().tolist()) <= {-1, 0, 1} and bool((d != 0).any())
    same = (d == 0).repeat_interleave(16, -1)
    assert torch.equal(e2m1.unpack(eager.codes)[same], e2m1.unpack(f32.codes)[same])


def test_guided_quantize_reproduces_and_brackets():
    x = _random(seed=2)
    q = kv.quantize(x, compute_dtype=torch.float32)
    rec = q.guidance(compact=False)
    assert isinstance(rec, FullGuidance) and rec.fmt == "sglang_kvfp4"
    g = kv.guided_quantize(x, rec)
    assert torch.equal(e2m1.decode(e2m1.unpack(g.codes)), e2m1.decode(e2m1.unpack(q.codes)))
    y = x * (1 + 1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(3)))
    gy = kv.guided_quantize(y, rec)  # the rollout's scales: z = y / 2**e, code within y's bracket
    z = y.reshape(*y.shape[:-1], 2, 16) / 2.0 ** (q.block_scales.view(torch.uint8).float() - 127).unsqueeze(-1)
    lo, hi = e2m1.bracket(z.reshape(y.shape))
    v = e2m1.decode(e2m1.unpack(gy.codes))
    assert bool(((v == lo) | (v == hi)).all())


def test_sglang_layout_round_trip_and_errors():
    x = _random(seed=4)
    q = kv.quantize(x)
    packed, scales = kv.to_sglang(q)
    assert packed.shape == (x.shape[0], 2, 16) and scales.shape == (x.shape[0], 4) and scales.dtype == torch.uint8
    back = kv.from_sglang(packed, scales)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.block_scales.view(torch.uint8),
                                                            q.block_scales.view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        kv.quantize(torch.randn(3, 24))
    with pytest.raises(ValueError, match="compute_dtype"):
        kv.quantize(torch.randn(3, 16), compute_dtype=torch.float16)
    with pytest.raises(NonFiniteError):
        kv.quantize(torch.tensor([[float("nan")] + [0.0] * 15]))
    with pytest.raises(ValueError, match="do not fit"):
        kv.from_sglang(packed, scales[:, :3])


def test_sglang_layout_of_no_rows():
    """0 rows (a read-out of 0 slots) in both directions (a reshape of 0 elements to [0, -1] raised)."""
    packed, scales = kv.to_sglang(kv.quantize(torch.randn(0, 2, 32)))
    assert packed.shape == (0, 2, 16) and scales.shape == (0, 4)
    back = kv.from_sglang(packed, scales)
    assert back.shape == (0, 2, 32) and tuple(back.block_scales.shape) == (0, 2, 2)


def test_the_exponent_follows_the_float32_division_amax_over_6():
    # amax two ulps above 96 = 6 * 16: the IEEE fp32 amax / 6 is one ulp above 16 and float32 log2 of it rounds to 4
    # (a reciprocal multiply lands two ulps above, where log2 rounds up): the block keeps e = 4 (the exact ceil is 5)
    # and its largest element saturates to 6
    a = np.nextafter(np.nextafter(np.float32(96), np.float32(200)), np.float32(200))
    r = np.float32(a) / np.float32(6)
    assert r == np.nextafter(np.float32(16), np.float32(200)) and torch.log2(torch.tensor(r)).item() == 4.0
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2] = float(a), -3.0, 40.0
    q = kv.quantize(x, compute_dtype=torch.float32)
    assert q.block_scales.view(torch.uint8).item() == 127 + 4
    assert e2m1.unpack(q.codes)[0, :3].tolist() == [7, 8, 5]  # 6.000002 -> 6, -0.1875 -> -0, 2.5 -> 3 (away)


def test_sglang_layout_is_the_flattened_row():
    # SGLang quantizes a token's [kv_heads * head_dim] row: scales[t, j] belongs to elements 16j .. 16j + 15 of it
    x = _random(n=20, seed=5)  # [20, 2, 32]
    packed, scales = kv.to_sglang(kv.quantize(x))
    flat = kv.quantize(x.reshape(20, 64))
    assert torch.equal(scales, flat.block_scales.view(torch.uint8))
    assert torch.equal(packed.reshape(20, 32), flat.codes)
    assert torch.equal(kv.dequantize(kv.from_sglang(packed, scales), torch.float32).reshape(20, 64),
                       kv.dequantize(flat, torch.float32))


def test_sglang_layout_refuses_what_does_not_fit():
    packed, scales = kv.to_sglang(kv.quantize(_random(n=12)))
    with pytest.raises(ValueError, match=r"got torch.uint8 \(12, 2, 16\) and torch.int32 \(12, 4\)"):
        kv.from_sglang(packed, scales.int())
    with pytest.raises(ValueError, match="head_dim 24 must be a multiple of 16"):
        kv.from_sglang(torch.zeros(3, 2, 12, dtype=torch.uint8), torch.zeros(3, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"tensor \[T, heads, head_dim\], got sglang_kvfp4 \(3, 64\)"):
        kv.to_sglang(kv.quantize(torch.randn(3, 64)))
    with pytest.raises(ValueError, match="expected a sglang_kvfp4 tensor, got fmt='mxfp4'"):
        kv.dequantize(mxfp4.quantize(torch.randn(3, 64)))


def test_a_record_with_a_global_amax_is_refused():
    x = _random(n=12)
    rec = dataclasses.replace(kv.quantize(x).guidance(compact=True), global_amax=torch.tensor(1.0))
    with pytest.raises(GuidanceMismatchError, match="a sglang_kvfp4 record must not carry a global_amax"):
        kv.guided_quantize(x, rec)
