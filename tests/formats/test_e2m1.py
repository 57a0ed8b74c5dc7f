import numpy as np
import pytest
import torch

from megatron_trace.formats import e2m1

from ._independent import e2m1_codes

# value -> expected decoded value, for every RNE threshold, tie and saturation point
RNE_TABLE = [
    (0.0, 0.0), (0.24, 0.0), (0.25, 0.0), (0.26, 0.5), (0.5, 0.5), (0.74, 0.5), (0.75, 1.0),
    (1.0, 1.0), (1.25, 1.0), (1.26, 1.5), (1.5, 1.5), (1.74, 1.5), (1.75, 2.0), (2.0, 2.0),
    (2.5, 2.0), (2.51, 3.0), (3.0, 3.0), (3.49, 3.0), (3.5, 4.0), (4.0, 4.0), (5.0, 4.0),
    (5.01, 6.0), (6.0, 6.0), (6.5, 6.0), (1e30, 6.0),
]


def test_all_16_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1.decode(codes)
    assert torch.equal(e2m1.encode_rne(vals), codes)  # -0 (code 8) encodes back to 8
    assert vals[8].item() == 0.0 and torch.signbit(vals[8])


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("x,expected", RNE_TABLE)
def test_rne_thresholds_ties_and_saturation(x, expected, sign):
    for dtype in (torch.float32, torch.float64):
        got = e2m1.decode(e2m1.encode_rne(torch.tensor([sign * x], dtype=dtype)))
        assert got.item() == sign * expected


def test_ties_go_to_even_mantissa():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert torch.equal(e2m1.mantissa_bit(e2m1.encode_rne(ties)), torch.zeros(7, dtype=torch.uint8))


def test_negative_small_gives_negative_zero():
    assert e2m1.encode_rne(torch.tensor([-0.1, -0.0, 0.0])).tolist() == [8, 8, 0]


def test_matches_independent_bruteforce():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(20000, generator=g) * 3, torch.linspace(-7, 7, 2801)])
    assert np.array_equal(e2m1.encode_rne(x).numpy(), e2m1_codes(x.numpy()))


def test_pack_unpack_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = e2m1.pack(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(e2m1.unpack(packed), codes)


def test_pack_bits_order_and_round_trip():
    bits = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert e2m1.pack_bits(bits).tolist() == [[0x81, 0x02]]
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(0, 2, (5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(e2m1.unpack_bits(e2m1.pack_bits(rnd)), rnd)


def test_pack_bits_makes_no_tensor_from_host_data():
    """No ``torch.tensor(list, device=...)`` inside: on CUDA that copy waits for the stream, once per record and
    decode step in the rollout (it cost 20-30% of generate's time on the H200)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    bits = torch.randint(0, 2, (4, 32), dtype=torch.uint8)
    with Ops() as ops:
        e2m1.pack_bits(bits)
    assert ops.seen and not [f for f in ops.seen if f.startswith(("lift_fresh", "_to_copy", "copy"))], ops.seen


def test_pack_rejects_odd_and_wrong_dtype():
    with pytest.raises(ValueError, match="even last dim"):
        e2m1.pack(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        e2m1.unpack(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="divisible by 8"):
        e2m1.pack_bits(torch.zeros(7, dtype=torch.uint8))


@pytest.mark.parametrize("call,err,match", [
    # were: float bits packed as their truncation (0.7 as 0), a 0-d tensor a bare IndexError
    (lambda: e2m1.pack_bits(torch.full((8,), 0.7)), TypeError, "pack_bits needs 0/1 torch.uint8 .*got torch.float32"),
    (lambda: e2m1.pack_bits(torch.ones(8, dtype=torch.int64)), TypeError, "got torch.int64"),
    (lambda: e2m1.pack_bits(torch.tensor(1, dtype=torch.uint8)), ValueError, r"divisible by 8, got shape \(\)"),
    (lambda: e2m1.pack(torch.tensor(1, dtype=torch.uint8)), ValueError, r"even last dim, got shape \(\)"),
], ids=["float-bits", "int64-bits", "0-d-bits", "0-d-codes"])
def test_packers_name_bits_or_codes_they_cannot_pack(call, err, match):
    with pytest.raises(err, match=match):
        call()
    assert e2m1.pack_bits(torch.ones(8, dtype=torch.bool)).item() == 255  # (bool bits: a mask)


def test_adjacent_grid_points_differ_in_mantissa_bit():
    g = torch.tensor(e2m1.SIGNED_GRID)
    bits = e2m1.value_mantissa_bit(g)
    assert torch.all(bits[1:] != bits[:-1])


def test_bracket():
    lo, hi = e2m1.bracket(torch.tensor([2.4, 3.0, -0.2, 7.0, -9.0, 0.0, 5.5]))
    assert lo.tolist() == [2.0, 3.0, -0.5, 6.0, -6.0, 0.0, 4.0]
    assert hi.tolist() == [3.0, 3.0, 0.0, 6.0, -6.0, 0.0, 6.0]


def test_float4_x2_view_shares_bytes():
    packed = e2m1.pack(torch.arange(16, dtype=torch.uint8))
    f4 = e2m1.to_float4_x2(packed)
    assert f4.dtype == torch.float4_e2m1fn_x2
    assert torch.equal(e2m1.from_float4_x2(f4), packed)
    assert f4.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch casts to float4_e2m1fn_x2 only on CUDA builds")
def test_matches_torch_float4_cast_on_cuda():  # pragma: no cover - GPU only
    x = torch.linspace(-7, 7, 1001, device="cuda")
    try:
        ref = x.to(torch.float4_e2m1fn_x2)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch build cannot cast to float4: {e}")
    assert torch.equal(ref.view(torch.uint8).cpu(), e2m1.pack(e2m1.encode_rne(x).cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_decode_returns_the_asked_dtype(dtype):
    codes = torch.arange(16, dtype=torch.uint8)
    got = e2m1.decode(codes, dtype)
    assert got.dtype == dtype  # every E2M1 value is exact in each of them
    assert torch.equal(got.float(), e2m1.decode(codes)) and torch.equal(torch.signbit(got), codes >= 8)


def test_encode_value_takes_only_a_zero_sign_from_sign_like():
    values = torch.tensor([-1.0, 0.0, 2.0, 0.0, -6.0, -0.0])
    like = torch.tensor([1.0, -3.0, -1.0, 2.0, 5.0, 1.0])  # opposite signs on the non-zero values: ignored
    assert e2m1.encode_value(values, sign_like=like).tolist() == [10, 8, 4, 0, 15, 0]
    assert e2m1.encode_value(values).tolist() == [10, 0, 4, 0, 15, 8]


def test_pack_uses_only_the_low_nibble_of_each_code():
    # check_codes does not read values: a stray high bit must not leak into the neighbouring element's nibble
    codes = torch.tensor([[0xF3, 0x21, 0x10, 0xAB]], dtype=torch.uint8)
    assert e2m1.pack(codes).tolist() == [[0x13, 0xB0]]
    assert torch.equal(e2m1.unpack(e2m1.pack(codes)), codes & 0xF)


def test_float4_x2_view_refuses_other_dtypes():
    with pytest.raises(TypeError, match="uint8, got torch.int8"):
        e2m1.to_float4_x2(torch.zeros(4, dtype=torch.int8))
