"""Triton quantize / guided / dequantize kernels are bit-exact twins of the CPU reference (formats).

Each case runs the kernel on the Triton device and the reference on the CPU with the same inputs,
then compares codes, scales, global amax, mantissa bits and dequantized values bit for bit.
"""

import pytest
import torch

from megatron_trace.formats import CompactGuidance, FP4Tensor, FullGuidance, NonFiniteError, Quantizer
from megatron_trace.formats import block as ref_block

from ._gpu import DEVICE, INTERPRET, assert_same_fp4, bits, edge_rows, needs_triton, random_rows, same_bits

pytestmark = needs_triton

if DEVICE is not None:
    from megatron_trace.kernels import dequant_triton, fused, quant_triton
    from megatron_trace.kernels.checks import FiniteCounter, raise_if_bad


@pytest.fixture(autouse=True)
def _ieee_division_in_interpreter(monkeypatch):
    """The CPU interpreter emulates fma unfused, so the reciprocal + Markstein division is GPU-only."""
    if INTERPRET:
        monkeypatch.setattr(quant_triton, "FAST_DIV", False)


PREFETCH_IN_INTERPRETER = ("test_quantize_record_dequantize_bit_exact",
                           "test_guided_quantize_and_fused_dequant_bit_exact", "test_rows_of_several_tiles_bit_exact")


@pytest.fixture(autouse=True, params=["pair", "elem", "pair-tile32", "pair-prefetch"])
def kernel_variant(request, monkeypatch):
    """Every case runs on the word-pair kernel, the element kernel, with 32-element tiles (loops over K), and
    with 64-element tiles in a prefetching grid of 2 programs per multiprocessor (the interpreter counts one): a
    program loops over several row groups, loading the next while it rounds the current. No launch config takes
    the prefetching grid, so in the interpreter only the two main matrices (``PREFETCH_IN_INTERPRETER``) run it
    (stage 2 of CI: about 2 minutes less); the GPU runs every case."""
    if DEVICE is None:
        return request.param
    if request.param.endswith("prefetch") and INTERPRET and request.function.__name__ not in PREFETCH_IN_INTERPRETER:
        pytest.skip("the prefetching grid runs the main matrices only in the interpreter (every case on the GPU)")
    monkeypatch.setattr(quant_triton, "PAIR_KERNEL", request.param != "elem")
    if request.param.endswith("tile32"):
        monkeypatch.setattr(quant_triton, "CONFIG", {name: {"tile": 32, "num_warps": 4}
                                                     for name in quant_triton.CONFIG})
    if request.param.endswith("prefetch"):
        monkeypatch.setattr(quant_triton, "CONFIG", {
            name: {"tile": 64, "num_warps": 4, **({"programs_per_sm": 2} if name.startswith("pair") else {})}
            for name in quant_triton.CONFIG})
    return request.param

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
POLICIES = {
    "nvfp4-tensor": Quantizer("nvfp4"),
    "nvfp4-row": Quantizer("nvfp4", per_row=True),
    "mxfp4-floor": Quantizer("mxfp4", scale_rule="floor"),
    "mxfp4-ceil": Quantizer("mxfp4", scale_rule="ceil"),
}
SHAPES = [(4, 40), (2, 3, 64), (1, 33)] if INTERPRET else [(4, 40), (2, 3, 64), (1, 33), (3, 5000), (257, 2048)]


def _inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return random_rows(shape, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_record_dequantize_bit_exact(shape, policy, dtype):
    q = POLICIES[policy]
    x = _inputs(shape, dtype, 0)
    ref = q.quantize(x)
    t, rec, _ = fused.quantize(x.to(DEVICE), q, record=True)
    assert_same_fp4(t, ref)
    assert_same_fp4(rec, ref.guidance(compact=True))
    assert_same_fp4(dequant_triton.compact(t), ref.guidance(compact=True))
    for out in (torch.float32, torch.bfloat16, torch.float16):
        assert same_bits(dequant_triton.dequantize(t, out), ref.dequantize(out)), out


@pytest.mark.parametrize("policy", ["nvfp4-row", "mxfp4-floor"])
def test_rows_of_several_tiles_bit_exact(policy):
    """Rows of 160 elements: 3 tiles of 64 (the last one partial), 5 of 32. The interpreter's ``SHAPES`` fit one
    64-element tile per row, so there the prefetching grid (for rows of one tile only) never met longer rows."""
    q = POLICIES[policy]
    x = _inputs((5, 160), torch.bfloat16, 3)
    t = fused.quantize(x.to(DEVICE), q, check_finite=False)[0]
    assert_same_fp4(t, q.quantize(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_edge_inputs_bit_exact(policy, dtype):
    q = POLICIES[policy]
    x = edge_rows(dtype)
    ref = q.quantize(x)
    t, rec, _ = fused.quantize(x.to(DEVICE), q, record=True)
    assert_same_fp4(t, ref)
    assert_same_fp4(rec, ref.guidance(compact=True))
    assert same_bits(dequant_triton.dequantize(t, dtype), ref.dequantize(dtype))


@pytest.mark.parametrize("given", ["scalar", "tensor0d", "per-row"])
def test_given_global_amax(given):
    x = _inputs((6, 48), torch.bfloat16, 1)
    amax = {"scalar": 3.5, "tensor0d": torch.tensor(7.25), "per-row": torch.rand(6, 1) * 4 + 0.1}[given]
    q = Quantizer("nvfp4")
    ref = q.quantize(x, global_amax=amax)
    amax_dev = amax.to(DEVICE) if isinstance(amax, torch.Tensor) else amax
    t, _, _ = fused.quantize(x.to(DEVICE), q, global_amax=amax_dev)
    assert_same_fp4(t, ref)


@pytest.mark.parametrize("shape", [(3, 5, 64)] if INTERPRET else [(64, 1000), (64, 1024)], ids=str)
@pytest.mark.parametrize("compact", [False, True], ids=["full", "compact"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_guided_quantize_and_fused_dequant_bit_exact(dtype, policy, compact, shape):
    q = POLICIES[policy]
    x_roll = _inputs(shape, dtype, 2)
    gen = torch.Generator().manual_seed(3)
    x_train = (x_roll.float() * (1 + 0.05 * torch.randn(shape, generator=gen))).to(dtype)  # train-rollout drift
    record = q.quantize(x_roll).guidance(compact=compact)
    ref = q.guided_quantize(x_train, record)
    rec_dev = _to(record, DEVICE)
    t, out = fused.guided(x_train.to(DEVICE), rec_dev, deq_dtype=dtype, want_mask=True)
    assert_same_fp4(t, ref)
    assert same_bits(out["deq"].reshape(shape), ref.dequantize(dtype))


@pytest.mark.parametrize("guided", [False, True], ids=["own", "guided"])
@pytest.mark.parametrize("policy", ["nvfp4-row", "mxfp4-ceil"])
def test_fake_quantize_forward_and_ste_backward(policy, guided):
    base = POLICIES[policy]
    q = Quantizer(base.fmt, per_row=base.per_row, scale_rule=base.scale_rule, ste_clip=True)
    x = _inputs((8, 96), torch.bfloat16, 4)
    record = q.quantize(x * 0.9).guidance(compact=True) if guided else None
    gen = torch.Generator().manual_seed(5)
    grad = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
    xr = x.clone().requires_grad_(True)
    yr = q.fake_quantize(xr, guidance=record)
    yr.backward(grad)
    xt = x.to(DEVICE).requires_grad_(True)
    yt = fused.fake_quantize(xt, q, guidance=_to(record, DEVICE) if guided else None)
    yt.backward(grad.to(DEVICE))
    assert same_bits(yt, yr)
    assert same_bits(xt.grad, xr.grad)


def test_non_finite_input_raises_reference_error():
    x = _inputs((4, 32), torch.float32, 6)
    x[2, 7] = float("nan")
    with pytest.raises(NonFiniteError, match="first at index"):
        fused.quantize(x.to(DEVICE), POLICIES["nvfp4-row"])
    with pytest.raises(NonFiniteError):
        fused.quantize(x.to(DEVICE), POLICIES["nvfp4-tensor"])


@pytest.mark.parametrize("policy", ["nvfp4-row", "nvfp4-tensor", "mxfp4-floor"])
@pytest.mark.parametrize("guided", [False, True], ids=["rne", "guided"])
def test_deferred_check_counts_and_keeps_non_finite(policy, guided):
    """A deferred counter: no error in the call, NaN/Inf pass through to the fake-quant output where they
    were, every other row is bit-identical to the checked call on the clean rows, one raise names the site."""
    q = POLICIES.get(policy) or Quantizer("mxfp4")
    x = _inputs((6, 64), torch.bfloat16, 7)
    clean = x.clone()
    x[1, 5], x[3, 40], x[4, 0] = float("nan"), float("inf"), -float("inf")
    record = q.quantize(_inputs((6, 64), torch.float32, 8)).guidance(compact=True) if guided else None
    counter = FiniteCounter("layer 3 expert_fc1_in")
    kw = dict(guidance=_to(record, DEVICE)) if guided else {}
    y = fused.fake_quantize(x.to(DEVICE), q, check_finite=counter, **kw).cpu()
    assert int(counter.tensor(DEVICE).item()) > 0
    bad = ~torch.isfinite(x)
    assert not torch.isfinite(y[bad]).any()  # no finite garbage where the input was NaN/Inf
    if policy != "nvfp4-tensor" or guided:  # (an Inf in a tensor's own amax makes every value NaN)
        assert same_bits(y[bad], x[bad])  # NaN stays NaN, +-Inf stays +-Inf
        want = fused.fake_quantize(clean.to(DEVICE), q, **kw).cpu()
        rows = torch.tensor([0, 2, 5])
        assert same_bits(y[rows], want[rows])  # the rows without NaN/Inf are unaffected
    with pytest.raises(NonFiniteError, match="layer 3 expert_fc1_in"):
        raise_if_bad([counter])
    raise_if_bad([counter])  # read and reset: a second check passes


@pytest.mark.parametrize("policy", ["nvfp4-row", "nvfp4-tensor"])  # (the amax pass counts in the second)
def test_a_deferred_count_past_two_to_the_32_does_not_wrap(policy):
    """The counter is int64: an int32 one wraps past 2**31 NaN/Inf values (an all-NaN stacked weight of 2**31
    elements or more) and reads 0, no error, at 2**32. Here it holds 2**32 - 2 when the kernels add 3."""
    counter = FiniteCounter("layer 0 weights")
    counter.tensor(DEVICE).fill_(2**32 - 2)
    x = _inputs((3, 64), torch.bfloat16, 4)
    x[0, 1], x[2, 63], x[1, 30] = float("nan"), float("inf"), -float("inf")
    fused.fake_quantize(x.to(DEVICE), POLICIES[policy], check_finite=counter)
    with pytest.raises(NonFiniteError, match=r"\(layer 0 weights: 4294967297 NaN/Inf value\(s\)\)"):
        raise_if_bad([counter])


def test_deferred_check_counts_a_bad_given_amax():
    counter = FiniteCounter("layer 0 weights")
    x = _inputs((4, 32), torch.float32, 9).to(DEVICE)
    amax = torch.tensor([[1.0], [float("nan")], [2.0], [0.0]], device=DEVICE)
    fused.fake_quantize(x, Quantizer("nvfp4"), global_amax=amax, check_finite=counter)
    assert int(counter.tensor(DEVICE).item()) == 2
    with pytest.raises(ValueError, match="finite and > 0"):
        fused.fake_quantize(x, Quantizer("nvfp4"), global_amax=amax)


def _stacked(shape, dtype) -> torch.Tensor:
    """Slices [j] at scales 2**-8 ... 2**8, slice 1 all zeros (its amax is 0)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    x = x * torch.tensor([2.0 ** (4 * (j % 5) - 8) for j in range(shape[0])]).reshape(-1, *[1] * (len(shape) - 1))
    x[1] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 6, 64), (3, 2, 5, 40)], ids=str)
def test_stacked_equals_each_slice_alone(shape, dtype, monkeypatch):
    """``stacked``: x[j] fake-quantized (and quantized) with its own per-tensor amax, as the reference does
    slice by slice; the amax pass loops over its partial maxima in steps of 2 here."""
    monkeypatch.setattr(quant_triton, "ABSMAX_BLOCK", 16)
    monkeypatch.setattr(quant_triton, "ABSMAX_PARTS", 2)
    q = POLICIES["nvfp4-tensor"]
    x = _stacked(shape, dtype)
    y = fused.fake_quantize(x.to(DEVICE), q, stacked=True, check_finite=True).cpu()
    assert same_bits(y, torch.stack([q.fake_quantize(x[j]) for j in range(shape[0])]))
    t = fused.quantize(x.to(DEVICE), q, stacked=True)[0]
    for j in range(shape[0]):
        want = q.quantize(x[j])
        assert torch.equal(t.codes[j].cpu(), want.codes)
        assert torch.equal(t.block_scales[j].cpu().view(torch.uint8), want.block_scales.view(torch.uint8))
        assert torch.equal(t.global_amax[j].cpu(), want.global_amax.expand(*shape[1:-1], 1))


@pytest.mark.parametrize("last_first", [True, False], ids=["last-first", "first-first"])
def test_amax_pass_in_either_order(last_first, kernel_variant, monkeypatch):
    """The per-tensor amax pass in partial maxima of 16 elements, its programs taking x's blocks (and a stacked
    x's slices) from the end (``ABSMAX_LAST_FIRST``) or from the start: the reference's bits with the largest
    element in the first, a middle or the last block, a NaN there counted, each slice of a stacked x its own."""
    if kernel_variant != "pair":
        pytest.skip("the amax pass is one kernel whichever quantize kernel follows it")
    monkeypatch.setattr(quant_triton, "ABSMAX_BLOCK", 16)
    monkeypatch.setattr(quant_triton, "ABSMAX_LAST_FIRST", last_first)
    q = POLICIES["nvfp4-tensor"]
    for at in (0, 57, 127):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(at)).to(torch.bfloat16)
        x.view(-1)[at] = -1000.0
        assert_same_fp4(fused.quantize(x.to(DEVICE), q)[0], q.quantize(x))
        x.view(-1)[at] = float("nan")
        counter = FiniteCounter("x")
        fused.quantize(x.to(DEVICE), q, check_finite=counter)
        assert int(counter.tensor(DEVICE).item()) > 0
    x = _stacked((4, 6, 64), torch.bfloat16)
    y = fused.fake_quantize(x.to(DEVICE), q, stacked=True).cpu()
    assert same_bits(y, torch.stack([q.fake_quantize(x[j]) for j in range(4)]))


def test_stacked_reference_path_and_bad_uses():
    from megatron_trace.kernels import ops

    q = POLICIES["nvfp4-tensor"]
    x = _stacked((3, 4, 32), torch.bfloat16)
    want = torch.stack([q.fake_quantize(x[j]) for j in range(3)])
    assert same_bits(ops.fake_quantize(x, q, stacked=True, kernel="reference"), want)
    assert same_bits(fused.fake_quantize(x.to(DEVICE), q, stacked=True).cpu(), want)
    mx = Quantizer("mxfp4")  # blocks are independent: stacked changes nothing
    assert same_bits(ops.fake_quantize(x, mx, stacked=True, kernel="reference"), mx.fake_quantize(x))
    assert same_bits(fused.fake_quantize(x.to(DEVICE), mx, stacked=True).cpu(), mx.fake_quantize(x))
    for bad in (dict(quantizer=POLICIES["nvfp4-row"]), dict(global_amax=torch.ones(()))):
        with pytest.raises(ValueError, match="stacked needs"):
            ops.fake_quantize(x.to(DEVICE), bad.pop("quantizer", q), stacked=True, **bad)
    with pytest.raises(ValueError, match="groups=5 must be >= 1 and divide the 12 rows"):
        quant_triton.absmax_rows(x.reshape(12, 32).to(DEVICE), 5, None)


def test_stacked_counts_non_finite_once_deferred():
    """A NaN in slice 2 is counted into the deferred counter by the amax pass (the fake-quant launch then
    counts nothing), and the other slices equal their clean fake-quant."""
    q = POLICIES["nvfp4-tensor"]
    x = _stacked((4, 3, 32), torch.bfloat16)
    clean = x.clone()
    x[2, 1, 7], x[2, 0, 0] = float("nan"), float("inf")
    counter = FiniteCounter("layer 0 weights")
    y = fused.fake_quantize(x.to(DEVICE), q, stacked=True, check_finite=counter).cpu()
    assert int(counter.tensor(DEVICE).item()) == 2
    want = fused.fake_quantize(clean.to(DEVICE), q, stacked=True).cpu()
    assert same_bits(y[[0, 1, 3]], want[[0, 1, 3]])
    with pytest.raises(NonFiniteError):
        fused.fake_quantize(x.to(DEVICE), q, stacked=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("policy", ["mxfp4-floor", "mxfp4-ceil"])
def test_unchecked_mxfp4_inf_blocks_equal_the_element_kernel(policy, dtype, kernel_variant, monkeypatch):
    """MXFP4 divides by nothing (z = x * 2**-e), so its pair tile rounds blocks with Inf itself (no exact redo):
    unchecked (``check_finite=False``), Inf gives the element kernel's codes, scales and fake-quant output, it
    saturates to code 7 with its sign, and its block takes the largest exponent of the rule. (An unchecked NaN
    is garbage by contract: the pair tile's code is 7, the element tile's -0.)"""
    q = POLICIES[policy]
    x = torch.cat([edge_rows(dtype), _inputs((4, 64), dtype, 11)])
    x[-4, 3], x[-3, 40], x[-2, 0], x[-2, 33], x[-1, 7] = float("inf"), -float("inf"), float("inf"), -float("inf"), 0
    x[-1, 8:32] = float("inf")  # a block of Inf only
    xd = x.to(DEVICE)
    got = fused.quantize(xd, q, check_finite=False)[0]
    got_fq = fused.fake_quantize(xd, q, check_finite=False).cpu()
    monkeypatch.setattr(quant_triton, "PAIR_KERNEL", False)
    want = fused.quantize(xd, q, check_finite=False)[0]
    assert_same_fp4(got, want)
    assert same_bits(got_fq, fused.fake_quantize(xd, q, check_finite=False).cpu())
    codes = torch.stack([got.codes.cpu() & 15, got.codes.cpu() >> 4], -1).flatten(-2)
    inf = torch.isinf(x)
    assert torch.equal(codes[inf], torch.where(x[inf] > 0, 7, 15).to(torch.uint8))
    e_max = 126 if q.format.scale_rule == "floor" else 127  # floor(log2 Inf) - 2 from the exponent field; ceil: 127
    blocks = inf.unflatten(-1, (-1, 32)).any(-1)
    assert bool((got.block_scales.view(torch.uint8).cpu()[blocks] == e_max + 127).all())


def _to(record, device):
    if record is None:
        return None
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in record.__dict__.items()}
    return type(record)(**kw)


@pytest.mark.parametrize("policy", ["nvfp4-tensor", "nvfp4-row"])
def test_ieee_division_path_is_bit_exact_too(policy, monkeypatch):
    monkeypatch.setattr(quant_triton, "FAST_DIV", False)  # tl.div_rn everywhere instead of reciprocal + Markstein
    q = POLICIES[policy]
    x = torch.cat([_inputs((16, 64), torch.float32, 7), edge_rows(torch.float32)])
    ref = q.quantize(x)
    t, _, _ = fused.quantize(x.to(DEVICE), q)
    assert_same_fp4(t, ref)
    assert same_bits(dequant_triton.dequantize(t, torch.float32), ref.dequantize(torch.float32))


_Z = [0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5,
      6.0, 7.0, 7.5, -0.0, -0.25, -0.75, -1.25, -2.5, -5.0, -0.1, -6.0]  # MXFP4 block amax 7.5: scale 1, z == x


@pytest.mark.parametrize("compact", [False, True], ids=["full", "compact"])
def test_guided_every_record_code_on_ties_and_zeros(compact):
    """Each rollout code (full) or mantissa bit (compact) against grid points, midpoints and signed zeros."""
    q = Quantizer("mxfp4", scale_rule="floor")
    x = torch.tensor(_Z).repeat(16, 1)  # [16, 32]: row r gets rollout code r everywhere
    base = q.quantize(x).guidance(compact=False)
    codes = torch.arange(16, dtype=torch.uint8)[:, None].expand(16, 16)
    full = type(base)(**{**base.__dict__, "codes": (codes | (codes << 4)).contiguous()})
    record = Quantizer("mxfp4").quantize(x).guidance(compact=True) if compact else full
    if compact:
        bits = torch.where(torch.arange(16)[:, None] % 2 == 1, 0xA5, 0x5A).to(torch.uint8).expand(16, 4)
        record = type(record)(**{**record.__dict__, "mantissa_bits": bits.contiguous()})
    ref = q.guided_quantize(x, record)
    t, out = fused.guided(x.to(DEVICE), _to(record, DEVICE), deq_dtype=torch.float32)
    assert_same_fp4(t, ref)
    assert same_bits(out["deq"], ref.dequantize(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("compact", [False, True], ids=["full", "compact"])
def test_guided_nvfp4_every_record_code_on_ties_and_zeros(compact, dtype, monkeypatch):
    """``test_guided_every_record_code_on_ties_and_zeros`` for NVFP4 (the tiles by magnitudes for bf16 / fp32, the
    E2M1-index tile for fp16): a per-row record with S_enc = 1 (global amax 2688) and block scale 1 (E4M3 0x38),
    so z == x, on grid points, midpoints and signed zeros, toward every rollout code (full) or both mantissa bits
    (compact), in every position of a block; a block of scale 0 (z = +0) in the last row. Codes, dequantized values
    and STE mask, by magnitudes and by E2M1 indices."""
    x = torch.tensor(_Z).repeat(16, 1).to(dtype)  # [16, 32]: two blocks a row
    sb = torch.full((16, 2), 0x38, dtype=torch.uint8)
    sb[15, 1] = 0  # a zero block scale
    kw = dict(block_scales=sb.view(torch.float8_e4m3fn), global_amax=torch.full((16, 1), 2688.0), shape=(16, 32),
              fmt="nvfp4")
    if compact:  # random bytes, each row's complement in the next: every element meets both bits
        b = torch.randint(0, 256, (8, 1, 4), generator=torch.Generator().manual_seed(30), dtype=torch.uint8)
        record = CompactGuidance(mantissa_bits=torch.cat([b, 255 - b], 1).reshape(16, 4), **kw)
    else:  # element j of row r: code (r + j) % 16, so every element meets every code
        codes = ((torch.arange(16)[:, None] + torch.arange(32)) % 16).to(torch.uint8)
        record = FullGuidance(codes=codes[:, 0::2] | (codes[:, 1::2] << 4), **kw)
    q = Quantizer("nvfp4", per_row=True)
    ref = q.guided_quantize(x, record)
    inside = (x.float().abs() <= 6.0).to(torch.uint8)
    inside[15, 16:] = 1  # z = 0
    for by_mag in (True, False):
        monkeypatch.setattr(quant_triton, "GUIDED_BY_MAGNITUDE", by_mag)
        t, out = fused.guided(x.to(DEVICE), _to(record, DEVICE), deq_dtype=dtype, want_mask=True)
        assert_same_fp4(t, ref)
        assert same_bits(out["deq"], ref.dequantize(dtype)), by_mag
        assert torch.equal(out["mask"].cpu(), inside), by_mag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["mxfp4-floor", "mxfp4-ceil"])
def test_mxfp4_block_amax_near_the_largest_float(policy, dtype):
    """MXFP4 blocks of amax 1.49 * 2**126 .. the dtype's largest value: the ceil rule's largest finite-input
    exponents 125 and 126 (z = x * 2**-126; values 4 and 6 then dequantize to Inf, as the reference's), the floor
    rule's 124 and 125: codes, scales, record, dequantized and fake-quantized values."""
    q = POLICIES[policy]
    big = torch.tensor([3.0e38, 2.6e38, 2.0**127, 1.5 * 2.0**126, 1.49 * 2.0**126, torch.finfo(dtype).max])
    x = (big.to(dtype).float()[:, None] * torch.linspace(1, -1, 32)).to(dtype)  # [6, 32]: one block a row
    ref = q.quantize(x)
    t, rec, _ = fused.quantize(x.to(DEVICE), q, record=True)
    assert_same_fp4(t, ref)
    assert_same_fp4(rec, ref.guidance(compact=True))
    assert same_bits(dequant_triton.dequantize(t, dtype), ref.dequantize(dtype))
    assert same_bits(fused.fake_quantize(x.to(DEVICE), q).cpu(), q.fake_quantize(x))


@pytest.mark.parametrize("compact", [False, True], ids=["full", "compact"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_guided_edge_inputs_bit_exact(policy, compact):
    """Guided rounding of the edge rows (ties, signed zeros, subnormal and huge values) toward another record."""
    q = POLICIES[policy]
    x = edge_rows(torch.float32)
    record = q.quantize(torch.flip(x, dims=[0])).guidance(compact=compact)  # rows of other magnitudes
    ref = q.guided_quantize(x, record)
    t, out = fused.guided(x.to(DEVICE), _to(record, DEVICE), deq_dtype=torch.float32)
    assert_same_fp4(t, ref)
    assert same_bits(out["deq"], ref.dequantize(torch.float32))


def _saturating_rows(dtype) -> torch.Tensor:
    """[6, 64] rows whose amax is below 2688 / FLT_MAX (NVFP4's S_enc saturates at FLT_MAX): random, with an
    all-zero block, one nonzero element, blocks 2**0 .. 2**-7 below the first, and (fp32) subnormals."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 64, generator=g) * 1e-37
    x[1, 16:32] = 0.0
    x[2] = 0.0
    x[2, 5] = -2e-38
    x[3] *= 2.0 ** -torch.arange(64).div(8).floor()  # blocks 2**0 .. 2**-7 below the row's first
    if dtype == torch.float32:
        x[5] *= 1e-4
    elif INTERPRET:  # the interpreter flushes half subnormals (see edge_rows): none in its rows
        x = torch.where(x.abs() < torch.finfo(dtype).smallest_normal, 0.0, x)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["nvfp4-tensor", "nvfp4-row"])
def test_saturated_encode_scale_bit_exact(policy, dtype):
    """Global amax below 2688 / FLT_MAX: quantize, record, dequantize and guided rounding give the reference's bits,
    S_enc = FLT_MAX (before it saturated, codes were all +-6 and a zero block's scale NaN)."""
    q = POLICIES[policy]
    x = _saturating_rows(dtype)
    ref = q.quantize(x)
    assert not ref.block_scales.float().isnan().any() and ref.dequantize().abs().amax() > 0
    t, rec, _ = fused.quantize(x.to(DEVICE), q, record=True)
    assert_same_fp4(t, ref)
    assert_same_fp4(rec, ref.guidance(compact=True))
    assert same_bits(dequant_triton.dequantize(t, dtype), ref.dequantize(dtype))
    gen = torch.Generator().manual_seed(13)
    x_train = (x.float() * (1 + 0.05 * torch.randn(x.shape, generator=gen))).to(dtype)
    for compact in (False, True):
        record = ref.guidance(compact=compact)
        want = q.guided_quantize(x_train, record)
        got, out = fused.guided(x_train.to(DEVICE), _to(record, DEVICE), deq_dtype=dtype)
        assert_same_fp4(got, want)
        assert same_bits(out["deq"].reshape(x.shape), want.dequantize(dtype))
    amax = torch.tensor(3e-37)  # a given (static) amax in the saturating range
    assert_same_fp4(fused.quantize(x.to(DEVICE), Quantizer("nvfp4"), global_amax=amax.to(DEVICE))[0],
                    Quantizer("nvfp4").quantize(x, global_amax=amax))


def _rne_edge_rows(dtype) -> torch.Tensor:
    """[R, 64] rows for RNE NVFP4 by magnitudes: per-row scaling makes z == x * 2**-j exactly on the first six
    (every block holds +-6 * 2**j), so z sits on the ties, their neighbours in ``dtype`` and the grid points; then
    z just above 6 (a block scale rounded down), zero block scales, and subnormal z from normal inputs."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).to(dtype)
    up = torch.nextafter(ties, torch.full_like(ties, 8.0)).float()
    dn = torch.nextafter(ties, torch.zeros_like(ties)).float()
    ties, grid = ties.float(), torch.tensor([0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    six = torch.ones(1) * 6
    base = torch.cat([six, ties, grid, -six, -ties, -grid, six, up, -dn, six * 0.98, -six, dn, -up, -six * 0.98])
    tiny = torch.arange(-7.0, 8.0) * 2.0**-126  # normal in bf16; z ~ 2**-133 next to a block amax of 2**10
    rows = [base * 2.0**j for j in (0, -3, 20, -20, 90, -90)] + [
        torch.cat([base[:16], torch.linspace(-5.3, 5.3, 16), torch.linspace(5.0, 5.3, 16),
                   -torch.linspace(4.9, 5.3, 16)]),  # sf 384 for 5.3 (bf16 5.3125): z up to 6.2
        torch.cat([base[:16], torch.linspace(-1e-5, 1e-5, 16), torch.zeros(16), -torch.zeros(16)]),  # sf == 0
        torch.cat([torch.full((1,), 1024.0), tiny, -tiny, torch.full((1,), -1024.0), base[:32] * 2.0**-100]),
    ]
    if dtype == torch.float32:  # fp32 subnormal inputs (the interpreter flushes bf16 subnormals)
        rows.append(torch.cat([base[:16], torch.arange(-24.0, 24.0) * 2.0**-149]))
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("amax", ["per-row", "per-tensor", "given"])
@pytest.mark.parametrize("codes", [False, True], ids=["fake-quant", "codes+record"])
def test_rne_by_magnitude_ties_and_edges_bit_exact(dtype, amax, codes, monkeypatch):
    """RNE NVFP4 by fp32 magnitudes (``quant_triton.RNE_BY_MAGNITUDE``) and by E2M1 indices against the reference:
    dequantized values, STE mask, codes, scales and record bits (a given amax of 1: z far above 6, saturated)."""
    q = Quantizer("nvfp4", per_row=amax == "per-row")
    ga = 1.0 if amax == "given" else None
    x = _rne_edge_rows(dtype)
    ref = q.quantize(x, global_amax=ga)
    _, z = ref_block.quantize_with_z(q.format, x, global_amax=ga, per_row=q.per_row)
    inside = (z.abs() <= 6.0).flatten(-2)[..., : x.shape[-1]].to(torch.uint8)
    outs = []
    for by_mag in (True, False):
        monkeypatch.setattr(quant_triton, "RNE_BY_MAGNITUDE", by_mag)
        t, rec, out = fused.quantize(x.to(DEVICE), q, global_amax=ga, record=codes, write_codes=codes, deq_dtype=dtype,
                                     want_mask=True, check_finite=False)
        assert same_bits(out["deq"], ref.dequantize(dtype)), by_mag
        assert torch.equal(out["mask"].cpu(), inside), by_mag
        if codes:
            assert_same_fp4(t, ref)
            assert_same_fp4(rec, ref.guidance(compact=True))
        outs.append(out)
    for name, got in outs[0].items():
        assert torch.equal(bits(got), bits(outs[1][name])), name


def _tiny_quotient_record(rows: int) -> CompactGuidance:
    """A per-row NVFP4 record [rows, 64] with S_enc = 1 (global amax 2688) and block scales 1.875, 2, 2.25 and 448:
    for x = k * 2**-149 the quotient k / sf * 2**-149 lies above, at and below 2**-150, where RN(z) turns 0 (the
    guided tile's z != 0 test), or far below it."""
    sb = torch.tensor([0x3F, 0x40, 0x41, 0x7E], dtype=torch.uint8).repeat(rows, 1)
    return CompactGuidance(mantissa_bits=torch.full((rows, 8), 0xFF, dtype=torch.uint8),
                           block_scales=sb.view(torch.float8_e4m3fn), global_amax=torch.full((rows, 1), 2688.0),
                           shape=(rows, 64), fmt="nvfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", [0x00, 0xFF, 0x5A, "random"], ids=str)
def test_guided_compact_by_magnitude_ties_and_edges_bit_exact(dtype, pattern, monkeypatch):
    """Guided compact NVFP4 by magnitudes (``quant_triton.GUIDED_BY_MAGNITUDE``; on the GPU by directed roundings)
    against the reference and the E2M1-index tile: z on the ties, their neighbours and the grid points, above 6,
    zero block scales, subnormal z and quotients at 2**-150, toward records of every bit pattern."""
    q = Quantizer("nvfp4", per_row=True)
    x = _rne_edge_rows(dtype)
    cases = [(x, q.quantize(x).guidance(compact=True)), (x, q.quantize(x * 0.9).guidance(compact=True))]
    if dtype == torch.float32:  # fp32 subnormal inputs (the interpreter flushes bf16 subnormals)
        tiny = 2.0**-149 * torch.tensor([1.0, -1.0, 3.0, -3.0, 0.0, -0.0, 2.0, 2.0**20])
        cases.append((tiny.repeat(4, 8), _tiny_quotient_record(4)))
    gen = torch.Generator().manual_seed(5)
    for x, record in cases:
        if pattern == "random":
            mb = torch.randint(0, 256, record.mantissa_bits.shape, generator=gen, dtype=torch.uint8)
        else:
            mb = torch.full_like(record.mantissa_bits, pattern)
            mb[1::2] = 255 - pattern
        record = CompactGuidance(**{**record.__dict__, "mantissa_bits": mb})
        ref = q.guided_quantize(x, record)
        outs = []
        for by_mag in (True, False):
            monkeypatch.setattr(quant_triton, "GUIDED_BY_MAGNITUDE", by_mag)
            t, out = fused.guided(x.to(DEVICE), _to(record, DEVICE), deq_dtype=dtype)
            assert_same_fp4(t, ref)
            assert same_bits(out["deq"], ref.dequantize(dtype)), by_mag
            outs.append(out)
        assert torch.equal(bits(outs[0]["deq"]), bits(outs[1]["deq"]))


def _every_mx_scale_tensor() -> FP4Tensor:
    """An MXFP4 tensor [8, 1024] whose 256 blocks take every E8M0 scale byte (0: 2**-127, a subnormal; 255: Inf),
    each block holding all 256 code bytes' nibbles: every code at every scale, and the code bytes in all 16
    positions of a block across rows."""
    rows, nb = 8, 32
    pos = torch.arange(nb * 16)
    codes = torch.stack([(pos * 17 + 16 * r) % 256 for r in range(rows)]).to(torch.uint8)
    scales = torch.arange(rows * nb, dtype=torch.int64).reshape(rows, nb).to(torch.uint8)
    return FP4Tensor(codes=codes, block_scales=scales.view(torch.float8_e8m0fnu), global_amax=None,
                     shape=(rows, nb * 32), fmt="mxfp4")


def test_mxfp4_dequantize_every_code_and_scale(monkeypatch):
    """MXFP4 to bf16 by per-block constants (the GPU's table path) and by E2M1 indices against the reference, bit
    for bit: every code at every scale byte, the subnormal 2**-127 and 2**-128 results and Inf / NaN (0 * Inf)."""
    t = _every_mx_scale_tensor()
    assert torch.equal(torch.unique(t.block_scales.view(torch.uint8)), torch.arange(256, dtype=torch.uint8))
    ref = t.dequantize(torch.bfloat16)
    got = []
    for by_consts in (True, False):
        monkeypatch.setattr(quant_triton, "DEQUANT_BY_MAGNITUDE", by_consts)
        got.append(dequant_triton.dequantize(_to(t, DEVICE), torch.bfloat16))
        assert same_bits(got[-1], ref), by_consts
    assert same_bits(got[0], got[1])


def _every_code_tensor(amax: str, nan_scale: bool):
    """An NVFP4 tensor [8, 512] whose code bytes take all 256 values in each of a block's 8 byte positions, with
    block scale bytes cycling over 0 (zero), 1-7 (E4M3 subnormal), the normals up to 448 and, if nan_scale, 0x7F;
    the global amax per tensor or per row (1e-3 .. 1e3, 0: S_enc = 1, and one below 2688 / 2**101: the exact redo)."""
    rows, nb = 8, 32
    pos = torch.arange(nb * 8)
    codes = torch.stack([(pos + r) % 256 for r in range(rows)]).to(torch.uint8)
    sb = torch.stack([(torch.arange(nb) * 5 + 32 * r) % (128 if nan_scale else 127) for r in range(rows)])
    scales = sb.to(torch.uint8).view(torch.float8_e4m3fn)
    if amax == "per-tensor":
        g = torch.tensor(3.5)
    else:
        g = torch.tensor([1e-3, 0.37, 1.0, 6.0, 1e3, 0.0, 1e-35, 2.0**-60]).reshape(rows, 1)
    return FP4Tensor(codes=codes, block_scales=scales, global_amax=g.float(), shape=(rows, nb * 16), fmt="nvfp4")


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("amax", ["per-row", "per-tensor"])
@pytest.mark.parametrize("nan_scale", [False, True], ids=["finite-scales", "nan-scale"])
def test_dequantize_by_block_consts_every_code_and_scale(out, amax, nan_scale, monkeypatch):
    """NVFP4 dequantize by per-block constants (``quant_triton.DEQUANT_BY_MAGNITUDE``) and by E2M1 indices against
    the reference, bit for bit: every code in every position (code 8 = -0), zero / subnormal / normal / NaN scales."""
    t = _every_code_tensor(amax, nan_scale)
    ref = t.dequantize(out)
    dev = _to(t, DEVICE)
    got = []
    for by_consts in (True, False):
        monkeypatch.setattr(quant_triton, "DEQUANT_BY_MAGNITUDE", by_consts)
        got.append(dequant_triton.dequantize(dev, out))
        assert same_bits(got[-1], ref), by_consts
    assert same_bits(got[0], got[1])


def _block_scale_rows(g_scale: float) -> torch.Tensor:
    """fp32 rows [9, 1024] of 64 blocks: block 0 holds the row amax g = 2688 * g_scale, every other block's amax
    a = 6 v / g_scale for v on each E4M3 value, each midpoint between neighbours (ties) and one fp32 ulp either
    side of it, and past 448 (which raise their row's amax, so that v stays <= 448 there: the clamp is
    ``test_block_scales_past_448_are_clamped_with_a_given_amax``'s): the block scales' rounding at every boundary
    (for g_scale = 1, S_enc = 1 and v = a / 6 exactly)."""
    e4 = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = torch.unique(e4[torch.isfinite(e4) & (e4 >= 0)])  # 0, 2**-9 ... 448
    mids = (vals[1:] + vals[:-1]) / 2
    v = torch.cat([vals, mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 1e9)),
                   torch.tensor([449.0, 464.0, 500.0])])
    a = v * 6 / g_scale
    per_row = 63
    rows = -(-a.numel() // per_row)
    a = torch.cat([a, a[: rows * per_row - a.numel()]]).reshape(rows, per_row)
    gen = torch.Generator().manual_seed(11)
    sign = torch.where(torch.rand(rows, per_row, 15, generator=gen) < 0.5, -1.0, 1.0)
    frac = torch.rand(rows, per_row, 15, generator=gen) * sign
    blocks = torch.cat([a[..., None], a[..., None] * frac], dim=2)  # amax first, the rest below it, mixed signs
    head = torch.full((rows, 1, 16), 2688.0 * g_scale)
    return torch.cat([head, blocks], dim=1).reshape(rows, 1024)


@pytest.mark.parametrize("g_scale", [1.0, 3.0, 1 / 448], ids=["S_enc=1", "S_enc=1/3", "S_enc=448"])
def test_block_scales_at_every_e4m3_rounding_boundary(g_scale):
    """Per-row NVFP4 block scales (on the GPU by ``triton_fp4.nvfp4_block_scale_hw``: a Markstein division by 6
    and the hardware E4M3 conversion) against the reference on every E4M3 value, tie and neighbour, bit for bit."""
    q = Quantizer("nvfp4", per_row=True)
    x = _block_scale_rows(g_scale)
    ref = q.quantize(x)
    t, rec, _ = fused.quantize(x.to(DEVICE), q, record=True)
    assert_same_fp4(t, ref)
    assert_same_fp4(rec, ref.guidance(compact=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mxfp4_ceil_exponent_at_the_subnormal_quotient_boundary(dtype):
    """MXFP4 ceil: block amaxes whose amax / 6 is a subnormal just below, at and above 2**-127 (amax = 3 * 2**-126:
    ceil(log2) = -127, not -126; scale byte 0), and the normal neighbours 6 * 2**-126: every block's scale byte and
    codes equal the reference's."""
    q = POLICIES["mxfp4-ceil"]
    a = torch.tensor([3 * 2.0**-126, 6 * 2.0**-126, 3 * 2.0**-125, 2.0**-125, 5 * 2.0**-126])
    a = torch.cat([a, torch.nextafter(a, torch.zeros(())), torch.nextafter(a, torch.ones(()))]).to(dtype).float()
    frac = torch.linspace(-1, 1, 31)  # the rest of each block below its amax, both signs, through 0
    x = torch.cat([a[:, None], a[:, None] * frac], dim=1)  # [15, 32]: one block a row
    if INTERPRET and dtype != torch.float32:  # the interpreter flushes half subnormals (see edge_rows): none here
        x = torch.where(x.abs() < torch.finfo(dtype).smallest_normal, 0.0, x)
    x = x.to(dtype)
    ref = q.quantize(x)
    assert (ref.block_scales.view(torch.uint8)[0] == 0).all()  # 2**-127: the boundary case itself
    t, rec, _ = fused.quantize(x.to(DEVICE), q, record=True)
    assert_same_fp4(t, ref)
    assert_same_fp4(rec, ref.guidance(compact=True))


@pytest.mark.parametrize("amax", ["scalar", "per-row"])
def test_block_scales_past_448_are_clamped_with_a_given_amax(amax):
    """A given global amax below a block's amax puts S_enc * amax_b / 6 past 448 (the computed amaxes never do):
    just above 448, on the tie 464 between 448 and 480, past it and far past it, the block scale is 448 (0x7E), not
    the E4M3 rounding of the unclamped value (480, then 512's exponent overflowing into the sign bit)."""
    v = torch.tensor([447.0, 448.0, 449.0, 463.0, 464.0, 465.0, 480.0, 500.0, 512.0, 1e4, 1e30])
    x = (v[:, None] * 6 * torch.linspace(1, -1, 16)).reshape(1, -1).repeat(2, 1)  # S_enc = 1: v = block amax / 6
    g = 2688.0 if amax == "scalar" else torch.full((2, 1), 2688.0)
    q = Quantizer("nvfp4")
    ref = q.quantize(x, global_amax=g)
    assert (ref.block_scales.view(torch.uint8)[:, 1:] == 0x7E).all()
    gd = g.to(DEVICE) if isinstance(g, torch.Tensor) else g
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        t, _, out = fused.quantize(xd.to(DEVICE), q, global_amax=gd, deq_dtype=dtype, check_finite=False)
        assert_same_fp4(t, q.quantize(xd, global_amax=g))
        assert same_bits(out["deq"], q.quantize(xd, global_amax=g).dequantize(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_partial_last_tile_reads_nothing_past_the_row(dtype):
    """Per-row NVFP4 of rows of 3 blocks (48 elements: a tile of 4 blocks, the last one past the row): the padding
    reads no element of the next row, or of a wider tensor around a column slice, into the row amax, where values
    10**6 (10**30) times larger sit."""
    q = POLICIES["nvfp4-row"]
    x = _inputs((4, 48), dtype, 28) * torch.tensor([1.0, 1e6, 1.0, 1e6])[:, None].to(dtype)
    wide = torch.cat([_inputs((4, 48), dtype, 29), torch.full((4, 32), 1e30, dtype=dtype)], 1)
    for rows in (x, wide[:, :48]):
        ref = q.quantize(rows.contiguous())
        t, rec, _ = fused.quantize(rows.to(DEVICE), q, record=True)
        assert_same_fp4(t, ref)
        assert_same_fp4(rec, ref.guidance(compact=True))


def _views(dtype):
    """(name, x) non-contiguous views whose rows have unit stride along K: a column slice of wider rows, one
    half of a chunk, rows of an expanded (stride-0) tensor."""
    wide = _inputs((5, 80), dtype, 21)
    return [("column-slice", wide[:, :48]), ("chunk", wide.chunk(2, -1)[1]),
            ("expanded", _inputs((1, 32), dtype, 22).expand(4, 32))]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_non_contiguous_rows_are_read_through_their_strides(policy):
    """The per-tensor amax pass reads the view's own elements (not numel() elements from data_ptr); a NaN
    outside the view is not x's, one inside is."""
    q = POLICIES[policy]
    for name, x in _views(torch.bfloat16):
        assert not x.is_contiguous(), name
        t, rec, _ = fused.quantize(x.to(DEVICE), q, record=True)
        ref = q.quantize(x.contiguous())
        assert_same_fp4(t, ref)
        assert same_bits(fused.fake_quantize(x.to(DEVICE), q).cpu(), q.fake_quantize(x.contiguous()))
    wide = _inputs((5, 80), torch.bfloat16, 23)
    wide[2, 70] = float("nan")  # outside the view
    x = wide[:, :48]
    assert same_bits(fused.quantize(x.to(DEVICE), q)[0].codes, q.quantize(x.contiguous()).codes)
    wide[2, 7] = float("nan")  # inside
    with pytest.raises(NonFiniteError):
        fused.quantize(x.to(DEVICE), q)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 40)], ids=str)
def test_zero_rows_give_the_references_empty_results(policy, shape):
    """An expert-parallel rank can receive no tokens: every entry point returns empty tensors of the
    reference's shapes."""
    q = POLICIES[policy]
    x = torch.zeros(shape, dtype=torch.bfloat16)
    ref = q.quantize(x)
    t, rec, _ = fused.quantize(x.to(DEVICE), q, record=True)
    assert_same_fp4(t, ref)
    assert_same_fp4(rec, ref.guidance(compact=True))
    for compact in (False, True):
        record = _to(ref.guidance(compact=compact), DEVICE)
        g, _ = fused.guided(x.to(DEVICE), record)
        assert_same_fp4(g, q.guided_quantize(x, ref.guidance(compact=compact)))
        assert fused.fake_quantize(x.to(DEVICE), q, guidance=record).shape == shape
    assert fused.fake_quantize(x.to(DEVICE), q).shape == shape


def test_a_record_of_another_format_is_refused_like_the_reference():
    from megatron_trace.formats import GuidanceMismatchError

    x = _inputs((4, 64), torch.bfloat16, 24)
    record = Quantizer("mxfp4").quantize(x).guidance(compact=True)
    q = POLICIES["nvfp4-row"]
    with pytest.raises(GuidanceMismatchError, match="'mxfp4' != quantizer format 'nvfp4'"):
        q.fake_quantize(x, guidance=record)
    with pytest.raises(GuidanceMismatchError, match="'mxfp4' != quantizer format 'nvfp4'"):
        fused.fake_quantize(x.to(DEVICE), q, guidance=_to(record, DEVICE))
    for quantize in (lambda: Quantizer("mxfp4").quantize(x, global_amax=2.0),
                     lambda: fused.quantize(x.to(DEVICE), Quantizer("mxfp4"), global_amax=2.0)):
        with pytest.raises(ValueError, match="MXFP4 has no global amax"):
            quantize()


def test_a_record_only_format_is_refused_by_the_triton_guided_quantize(kernel_variant):
    """The kernel knows NVFP4 and MXFP4: an ``sglang_kvfp4`` record (blocks of 16, E8M0 scales) was taken for
    MXFP4 (``quant_triton.fmt_id``) instead of being refused."""
    if kernel_variant != "pair":
        pytest.skip("(no launch: one variant)")
    from megatron_trace.formats import sglang_kvfp4

    x = _inputs((4, 64), torch.bfloat16, 27)
    record = sglang_kvfp4.quantize(x).guidance(compact=True)
    with pytest.raises(ValueError, match="takes .'nvfp4', 'mxfp4'. records, got fmt='sglang_kvfp4'"):
        fused.guided(x.to(DEVICE), _to(record, DEVICE))


@pytest.mark.parametrize("stacked", [False, True], ids=["tensor", "stacked"])
def test_deferred_nan_stays_nan_with_a_per_tensor_amax(stacked):
    """NaN without Inf leaves a per-tensor amax finite: the fake-quant launch after the (counting) amax pass still
    passes the NaN through, and the counter holds it once."""
    q = POLICIES["nvfp4-tensor"]
    x = _inputs((4, 3, 32), torch.bfloat16, 25) if stacked else _inputs((6, 64), torch.bfloat16, 25)
    idx = (2, 1, 7) if stacked else (1, 5)
    x[idx] = float("nan")
    counter = FiniteCounter("layer 0 weights")
    y = fused.fake_quantize(x.to(DEVICE), q, stacked=stacked, check_finite=counter).cpu()
    assert torch.isnan(y[idx]) and int(torch.isnan(y).sum()) == 1
    assert int(counter.tensor(DEVICE).item()) == 1


def test_dequantize_to_other_dtypes():
    from megatron_trace.kernels import ops

    t = POLICIES["nvfp4-row"].quantize(_inputs((3, 32), torch.float32, 26))
    with pytest.raises(TypeError, match="writes bfloat16, float16 or float32, not torch.float64"):
        dequant_triton.dequantize(_to(t, DEVICE), torch.float64)
    assert same_bits(ops.dequantize(t, torch.float64), t.dequantize(torch.float64))
