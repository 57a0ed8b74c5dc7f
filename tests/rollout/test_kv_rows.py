"""``kv_rows.GrowingRows``: rows appended past a buffer's capacity (a new, larger buffer) keep every row so far."""

import pytest
import torch

from megatron_trace.rollout.kv_rows import MIN_GROWTH, GrowingRows


def test_growing_past_the_capacity_keeps_every_row():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 3, t, 4, generator=g) for t in (5, MIN_GROWTH + 20, 1, 3 * MIN_GROWTH, 1)]
    rows, caps = GrowingRows(), []
    for c in chunks:
        rows.append({"x": c, "y": -c})
        caps.append(rows.capacity)
        assert torch.equal(rows.view("x"), torch.cat(chunks[: len(caps)], 2))
    assert len(set(caps)) >= 3  # (it did grow, twice at least)
    assert torch.equal(rows.view("y"), -torch.cat(chunks, 2))
    for t in (1, 2 * MIN_GROWTH):  # the one-token writes' path: views of the next rows, grown first
        before = rows.view("x").clone()
        views = rows.next_rows(t)
        new = torch.randn(2, 3, t, 4, generator=g)
        views["x"].copy_(new)
        rows.length += t
        assert torch.equal(rows.view("x"), torch.cat([before, new], 2))


def test_a_token_in_another_format_is_refused_by_a_static_rows_write():
    """``FP4Rows.quantize_write_at`` on the reference path: the token's format must be the stored rows' (an MXFP4 token
    into NVFP4 rows would write codes and scales of another block size and no per-row amax: rows that dequantize
    to garbage); and a token of the same format lands at the device row, the others untouched."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.kv_rows import FP4Rows

    g = torch.Generator().manual_seed(1)
    nv, mx = TraceConfig().kv_quantizer(), TraceConfig(format="mxfp4").kv_quantizer()
    rows = FP4Rows(kernel="reference", reserve=16)
    rows.quantize_append(torch.randn(2, 1, 3, 32, generator=g), nv)
    before = rows.dequantize(torch.float32, capacity=True).clone()
    with pytest.raises(ValueError, match=r"token rows mxfp4 / head_dim 32 do not fit the stored \('nvfp4'"):
        rows.quantize_write_at(torch.randn(2, 1, 1, 32, generator=g), mx, torch.tensor([5]))
    assert torch.equal(rows.dequantize(torch.float32, capacity=True), before)
    x = torch.randn(2, 1, 1, 32, generator=g)
    rows.quantize_write_at(x, nv, torch.tensor([5]))
    after = rows.dequantize(torch.float32, capacity=True)
    assert torch.equal(after[:, :, 5:6], nv.quantize(x).dequantize(torch.float32))
    keep = [r for r in range(after.shape[2]) if r != 5]
    assert torch.equal(after[:, :, keep], before[:, :, keep])


@pytest.mark.parametrize("kw,match", [
    (dict(num_layers=2.0), r"FP4KVCache.num_layers=2.0 must be an int >= 1"),
    (dict(num_layers=0), r"FP4KVCache.num_layers=0 must be an int >= 1"),
    (dict(quantize_k="no"), r"FP4KVCache: quantize_k='no' must be a bool"),
    (dict(fused_decode=1, interval_masks=None), r"fused_decode=1, interval_masks=None must be bools"),
    (dict(kernel="tritonn"), r"kernel='tritonn' is not one of"),
    (dict(static_rows=64.0), r"static_rows=64.0 must be a positive multiple of 16"),
    (dict(static_rows="64"), r"static_rows='64' must be a positive multiple of 16"),
    (dict(bf16_layers={5}), r"FP4KVCache.bf16_layers=\[5\] must be layer ids in \[0, 2\)"),
    (dict(bf16_layers={"1"}), r"FP4KVCache.bf16_layers=\['1'\] must be layer ids in \[0, 2\)"),
])
def test_fp4_kv_cache_settings_are_checked_by_name(kw, match):
    """quantize_k="no" (truthy) quantized K, kernel="tritonn", num_layers=0 and bf16_layers outside the model (the
    layer meant kept in FP4) were taken, static_rows=64.0 failed deep in the first allocation and "64" with a bare
    TypeError."""
    from megatron_trace.formats import Quantizer
    from megatron_trace.rollout.kv_cache import FP4KVCache

    args = dict(num_layers=2, quantizer=Quantizer("nvfp4")) | kw
    with pytest.raises(ValueError, match=match):
        FP4KVCache(**args)
