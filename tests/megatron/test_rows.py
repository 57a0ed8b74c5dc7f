"""Guidance rows: token order conversion and the byte codec that carries rows through a dispatcher."""

import pytest
import torch

from megatron_trace.formats import CompactGuidance, Quantizer
from megatron_trace.megatron.rows import (
    RowCodec,
    RowGuidance,
    batch_major,
    decode_amax,
    encode_amax,
    payload_of,
    take,
    token_major,
)
from megatron_trace.megatron.step import as_mode


def _rows(fmt, k, compact, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 10
    x[2] = 0.0  # an all-zero row
    q = Quantizer(fmt=fmt, per_row=fmt == "nvfp4").quantize(x)
    valid = torch.rand(n, generator=g) > 0.3
    return RowGuidance(q.guidance(compact), valid)


@pytest.mark.parametrize("n", [7, 1, 0])  # 0 / 1 rows: a rank's share under EP (a row's slice is "contiguous")
@pytest.mark.parametrize("fmt,k", [("nvfp4", 64), ("nvfp4", 40), ("mxfp4", 64)])
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full"])
def test_codec_round_trip_is_bit_exact(fmt, k, compact, n):
    rows = take(_rows(fmt, k, compact), torch.arange(n))
    codec = RowCodec(fmt, k, compact)
    data = codec.encode(rows)
    assert data.dtype == torch.uint8 and tuple(data.shape) == (n, codec.width)
    back = codec.decode(data)
    assert torch.equal(back.valid, rows.valid)
    assert torch.equal(payload_of(back.record), payload_of(rows.record))
    assert torch.equal(back.record.block_scales.view(torch.uint8), rows.record.block_scales.view(torch.uint8))
    if fmt == "nvfp4":
        assert torch.equal(back.record.global_amax, rows.record.global_amax)
    else:
        assert back.record.global_amax is None
    assert back.record.shape == rows.record.shape


@pytest.mark.parametrize("n", [5, 1, 0])
def test_amax_columns_of_a_wider_buffer_decode_at_any_row_count(n):
    """The FC1 amax travels as 4 bytes among a dispatched row's columns (at an odd offset here): decoding that
    column slice gives the values back bit for bit, at 1 and 0 rows too (a slice that counts as contiguous), and an
    expanded amax encodes at any row count (an expanded [1, 1] counts as contiguous with stride 0)."""
    amax = torch.rand(n, 1) * 100
    buf = torch.cat([torch.zeros(n, 3, dtype=torch.uint8), encode_amax(amax), torch.zeros(n, 2, dtype=torch.uint8)], 1)
    assert torch.equal(decode_amax(buf[:, 3:7]).view(torch.int32), amax.view(torch.int32))
    one = torch.tensor(2.5).reshape(1, 1).expand(n, 1)  # a per-tensor amax sent with every row (``moe_step``)
    assert decode_amax(encode_amax(one)).flatten().tolist() == [2.5] * n


def test_codec_rejects_a_record_of_another_layout():
    rows = _rows("nvfp4", 64, compact=True)
    with pytest.raises(ValueError, match="does not fit"):
        RowCodec("nvfp4", 64, compact=False).encode(rows)
    with pytest.raises(ValueError, match="does not fit"):
        RowCodec("nvfp4", 32, compact=True).encode(rows)


def test_token_major_is_megatron_order_and_inverts():
    t = torch.arange(2 * 5 * 3).reshape(2, 5, 3)  # [B, S, X]
    tm = token_major(t, slice(0, 5))  # [S*B, X], row s*B + b
    for s in range(5):
        for b in range(2):
            assert torch.equal(tm[s * 2 + b], t[b, s])
    assert torch.equal(batch_major(tm, 2), t)
    assert torch.equal(token_major(t, slice(2, 4)), tm[4:8])  # a sequence-parallel shard


def test_take_selects_rows_of_every_field():
    rows = _rows("nvfp4", 32, compact=False)
    idx = torch.tensor([4, 0, 4])
    sub = take(rows, idx)
    assert sub.record.shape == (3, 32)
    assert torch.equal(sub.record.codes, rows.record.codes[idx])
    assert torch.equal(sub.record.global_amax, rows.record.global_amax[idx])
    assert torch.equal(sub.valid, rows.valid[idx])


def test_full_record_converts_to_compact_not_back():
    full = _rows("nvfp4", 32, compact=False).record
    compact = _rows("nvfp4", 32, compact=True).record
    derived = as_mode(full, compact=True)
    assert isinstance(derived, CompactGuidance)
    assert torch.equal(derived.mantissa_bits, compact.mantissa_bits)
    assert as_mode(compact, compact=False) is None
