"""The FP4 KV cache's decode write (one Triton quantize straight into the cache buffers, ``fused.quantize(out=)``)
stores, returns and records what quantize-then-copy does, bit for bit (``torch.equal`` on codes, scales, amax and
records): against the reference cache (``kernel="reference"``) for finite K/V, against the Triton quantize without
``out=`` for NaN/Inf and extreme rows. Non-contiguous K/V (transposes of [B, t, H, D]), head_dim 64 and 128, bf16
and fp16, buffer growth, batch selection.

On the CPU (``TRITON_INTERPRET=1``) the cache's Triton path is forced on (``kv_rows._on_triton``: a CPU tensor
never selects Triton) and buffers grow every few tokens; ``tests/gpu/test_kv_write_gpu.py`` runs the CUDA path.
"""

import pytest
import torch

from megatron_trace.formats import FP4Tensor, Quantizer
from megatron_trace.rollout import kv_cache, kv_rows

from ._gpu import DEVICE, INTERPRET, assert_same_fp4, edge_rows, needs_triton, random_rows, same_bits
from ._kv_write import QUANTIZERS, assert_same_runs, assert_tokens_stored, count_out_writes, run, steps

pytestmark = needs_triton

if DEVICE is not None:
    from megatron_trace.kernels import fused, quant_triton

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _triton_cache(monkeypatch):
    """Interpreter: IEEE division (its fma is unfused) and the cache's Triton path on CPU tensors."""
    if INTERPRET:
        monkeypatch.setattr(quant_triton, "FAST_DIV", False)
        monkeypatch.setattr(kv_rows, "_on_triton", lambda kernel, x, quantizer: kernel != "reference")
    monkeypatch.setattr(kv_rows, "MIN_GROWTH", 2)  # the buffers grow every few decode steps


@pytest.fixture
def writes(monkeypatch):
    """The ``fused.quantize`` calls with ``out=`` (the in-place decode writes), counted."""
    return count_out_writes(monkeypatch)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("policy", ["nvfp4-row", "mxfp4"])
def test_decode_writes_equal_quantize_then_copy(policy, dtype, d, writes):
    q = QUANTIZERS[policy]
    kv = steps(2, 3, d, 6, dtype, DEVICE, seed=d)
    got = run(q, kv)
    assert sum(writes) == 2 * 6  # every decode update of K and V was written in place
    assert got[0].get_seq_length() > 3 + kv_rows.MIN_GROWTH  # so the buffers grew during the decode
    assert_same_runs(got, run(q, kv, kernel="reference"))


@pytest.mark.parametrize("compact", [True, False, None], ids=["compact", "full", "no-recorder"])
def test_records_and_batch_selection(compact, writes):
    """The records (read from the stored history) are the same; a fork of batch rows keeps the in-place write
    (the selected buffers are contiguous)."""
    q = QUANTIZERS["nvfp4-row"]
    kv = steps(2, 2, 64, 5, torch.bfloat16, DEVICE, seed=1)
    select = (3, torch.tensor([1, 0, 1], device=DEVICE))
    got = run(q, kv, compact=compact, select=select)
    assert sum(writes) == 2 * 5
    assert_same_runs(got, run(q, kv, kernel="reference", compact=compact, select=select))


def test_per_tensor_amax_is_stored_per_row(writes):
    """NVFP4 with a per-tensor amax: the kernel writes codes and scales, the amax is copied into its rows."""
    q = QUANTIZERS["nvfp4-tensor"]
    kv = steps(2, 3, 64, 4, torch.bfloat16, DEVICE, seed=2)
    got = run(q, kv)  # (recorded from the stored history: per-row amax)
    assert sum(writes) == 2 * 4
    assert_same_runs(got, run(q, kv, kernel="reference"))


def _odd_tokens(dtype, d: int, b: int = 2, h: int = 8) -> list[torch.Tensor]:
    """Two decode tokens [B, H, 1, D] (transposes) of edge rows: ties, zeros, subnormal, huge, NaN and Inf."""
    e = edge_rows(dtype)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0]).repeat(16).to(dtype)
    rows = torch.cat([e, bad[None], -bad[None].roll(1, 1), e.flip(0)])
    rows = torch.cat([rows] * (d // 64), 1) if d > 64 else rows
    rows = torch.cat([rows, rows.roll(3, 0)] * 2)[: 2 * b * h]
    return [r.reshape(b, 1, h, d).transpose(1, 2).to(DEVICE) for r in rows.split(b * h)]


@pytest.mark.parametrize("d", [64] if INTERPRET else [64, 128])  # (128 on the GPU only: 33 s of CI's stage 2)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("policy", ["nvfp4-row", "mxfp4"])
def test_nonfinite_and_extreme_rows_equal_the_triton_quantize(policy, dtype, d, writes):
    """NaN/Inf are not checked (``check_finite=False``) and extreme rows take the kernel's exact redo: the token
    rows stored are those of the Triton quantize without ``out=``."""
    q = QUANTIZERS[policy]
    gen = torch.Generator().manual_seed(3)
    prefill = random_rows((2, 3, 8, d), dtype, gen).to(DEVICE).transpose(1, 2)  # [B, H=8, 3, D]
    toks = _odd_tokens(dtype, d)
    cache = kv_cache.FP4KVCache(1, q, fused_decode=True)
    cache.update(prefill, prefill, 0)
    for t in toks:
        cache.update(t, t, 0)
    assert sum(writes) == 2 * len(toks)
    assert_tokens_stored(cache, toks, q, 3)


@pytest.fixture(params=["pair", "elem", "pair-tile32"])
def kernel_variant(request, monkeypatch):
    """The word-pair kernel, the element kernel (writes fresh rows, then copies), 32-element tiles (loops over K)."""
    monkeypatch.setattr(quant_triton, "PAIR_KERNEL", request.param != "elem")
    if request.param.endswith("tile32"):
        monkeypatch.setattr(quant_triton, "CONFIG", {n: {"tile": 32, "num_warps": 4} for n in quant_triton.CONFIG})
    return request.param


def _buffers(q: Quantizer, b: int, h: int, cap: int, d: int) -> dict[str, torch.Tensor]:
    """Cache-like buffers [B, H, cap, ...] filled with a sentinel."""
    bufs = {"codes": torch.full((b, h, cap, d // 2), 0xAB, dtype=torch.uint8),
            "scales": torch.full((b, h, cap, d // q.block_size), 0xCD, dtype=torch.uint8)}
    if q.fmt == "nvfp4":
        bufs["amax"] = torch.full((b, h, cap, 1), -7.0)
    return {n: t.to(DEVICE) for n, t in bufs.items()}


def _out(q: Quantizer, bufs, pos: int, shape) -> FP4Tensor:
    rows = {n: t[:, :, pos : pos + 1] for n, t in bufs.items()}
    return FP4Tensor(codes=rows["codes"], block_scales=rows["scales"].view(q.format.scale_dtype),
                     global_amax=rows.get("amax"), shape=tuple(shape), fmt=q.fmt)


@pytest.mark.parametrize("policy", list(QUANTIZERS))
def test_quantize_out_writes_exactly_its_rows(policy, kernel_variant):
    q = QUANTIZERS[policy]
    gen = torch.Generator().manual_seed(4)
    x = random_rows((2, 1, 3, 64), torch.bfloat16, gen).to(DEVICE).transpose(1, 2)  # [B, H, 1, D]
    bufs = _buffers(q, 2, 3, 5, 64)
    before = {n: t.clone() for n, t in bufs.items()}
    t, rec, _ = fused.quantize(x, q, record=True, check_finite=False, out=_out(q, bufs, 2, x.shape))
    want, want_rec, _ = fused.quantize(x, q, record=True, check_finite=False)
    assert_same_fp4(t, want)
    assert_same_fp4(rec, want_rec)
    assert t.codes.data_ptr() == bufs["codes"][:, :, 2].data_ptr()  # the returned rows are the buffer's
    for name, buf in bufs.items():
        other = torch.ones(buf.shape[2], dtype=torch.bool)
        other[2] = False
        assert torch.equal(buf[:, :, other].cpu(), before[name][:, :, other].cpu()), name
    amax = want.global_amax
    if amax is not None:
        amax = amax.expand(2, 3, 1, 1) if amax.dim() == 0 else amax
        assert torch.equal(bufs["amax"][:, :, 2:3].cpu(), amax.cpu())


def test_quantize_out_names_what_does_not_fit():
    q = QUANTIZERS["nvfp4-row"]
    x = torch.randn(2, 3, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    bufs = _buffers(q, 2, 3, 5, 64)
    out = _out(q, bufs, 0, x.shape)
    with pytest.raises(ValueError, match="one row step"):  # amax rows of another capacity
        amax = torch.zeros(2, 3, 7, 1, device=DEVICE)[:, :, :1]
        fused.quantize(x, q, check_finite=False, out=FP4Tensor(codes=out.codes, block_scales=out.block_scales,
                                                                global_amax=amax, shape=out.shape, fmt=q.fmt))
    with pytest.raises(ValueError, match="fmt='mxfp4'"):
        fused.quantize(x, QUANTIZERS["mxfp4"], check_finite=False, out=out)
    with pytest.raises(ValueError, match="deq_dtype=None"):
        fused.quantize(x, q, check_finite=False, deq_dtype=torch.bfloat16, out=out)


@pytest.mark.parametrize("policy", ["nvfp4-row", "mxfp4"])
@pytest.mark.parametrize("tile32", [False, True], ids=["pair", "pair-tile32"])
def test_quantize_out_row_writes_at_the_device_row(policy, tile32, monkeypatch):
    """``out_row`` (a static cache's decode position): out given at row 0, the kernel writes row ``out_row[0]``
    only, the same bits as ``out`` given at that row."""
    if tile32:
        monkeypatch.setattr(quant_triton, "CONFIG", {n: {"tile": 32, "num_warps": 4} for n in quant_triton.CONFIG})
    q = QUANTIZERS[policy]
    gen = torch.Generator().manual_seed(5)
    x = random_rows((2, 1, 3, 64), torch.bfloat16, gen).to(DEVICE).transpose(1, 2)  # [B, H, 1, D]
    at, base = _buffers(q, 2, 3, 6, 64), _buffers(q, 2, 3, 6, 64)
    fused.quantize(x, q, check_finite=False, out=_out(q, at, 0, x.shape),
                   out_row=torch.tensor([4], device=DEVICE))
    fused.quantize(x, q, check_finite=False, out=_out(q, base, 4, x.shape))
    for name in at:
        assert torch.equal(at[name].cpu(), base[name].cpu()), name


def test_quantize_out_row_names_what_it_needs():
    x = torch.randn(2, 3, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    row = torch.tensor([1], device=DEVICE)
    q = QUANTIZERS["nvfp4-tensor"]  # a per-tensor amax would be copied at the host's row, not the device's
    with pytest.raises(ValueError, match="out_row needs out="):
        fused.quantize(x, q, check_finite=False, out=_out(q, _buffers(q, 2, 3, 5, 64), 0, x.shape), out_row=row)
    q = QUANTIZERS["nvfp4-row"]
    with pytest.raises(ValueError, match="out_row needs out="):
        fused.quantize(x, q, check_finite=False, out_row=row)
    out = _out(q, _buffers(q, 2, 3, 5, 64), 0, x.shape)
    for bad in (row.int(), torch.tensor([1, 2], device=DEVICE)):  # (the kernel reads one int64)
        with pytest.raises(ValueError, match=r"out_row must be int64 \[1\] on"):
            fused.quantize(x, q, check_finite=False, out=out, out_row=bad)


@pytest.mark.parametrize("policy", ["nvfp4-row", "mxfp4", "nvfp4-tensor"])
def test_static_decode_write_is_one_quantize_at_the_device_row(policy, writes):
    """A static cache's decode update: one in-place quantize at ``decode_position`` (NVFP4 per row, MXFP4), or
    quantize then ``index_copy_`` (per-tensor amax); the rows stored equal the growing cache's, bit for bit."""
    q = QUANTIZERS[policy]
    kv = steps(2, 3, 64, 4, torch.bfloat16, DEVICE, seed=6)
    static, grown = (kv_cache.FP4KVCache(1, q, static_rows=16), kv_cache.FP4KVCache(1, q))
    static.update(*kv[0], 0)
    grown.update(*kv[0], 0)
    n = len(writes)
    for i, (k, v) in enumerate(kv[1:]):
        static.decode_position().fill_(3 + i)
        static.update(k, v, 0)
        static.advance(1)
        grown.update(k, v, 0)
    assert sum(writes[n:]) == (2 * 4 * 2 if policy != "nvfp4-tensor" else 2 * 4)  # static (+ growing) in place
    for site in ("kv_k", "kv_v"):
        assert_same_fp4(static.layers[0].fp4_history(site), grown.layers[0].fp4_history(site))


@pytest.mark.parametrize("policy", ["nvfp4-row", "mxfp4"])
def test_row_writer_equals_quantize_at_the_device_row(policy):
    """``fused.RowWriter`` (a static cache's decode write kept across steps): for new rows and new device rows each
    call, the buffers hold what ``fused.quantize(out=, out_row=)`` writes, bit for bit."""
    q = QUANTIZERS[policy]
    gen = torch.Generator().manual_seed(7)
    rows = [random_rows((2, 1, 3, 64), torch.bfloat16, gen).to(DEVICE).transpose(1, 2) for _ in range(3)]
    kept, base = _buffers(q, 2, 3, 6, 64), _buffers(q, 2, 3, 6, 64)
    row = torch.zeros(1, dtype=torch.long, device=DEVICE)
    writer = fused.RowWriter(rows[0], q, _out(q, kept, 0, rows[0].shape), row)
    for i, x in enumerate(rows):
        row.fill_(2 * i + 1)
        assert writer.fits(x, q, row)
        writer(x)
        fused.quantize(x, q, check_finite=False, out=_out(q, base, 0, x.shape), out_row=row)
    for name in kept:
        assert torch.equal(kept[name].cpu(), base[name].cpu()), name
    written = (kept["codes"] != 0xAB).any(-1).any(0).any(0)  # per buffer row
    assert written.tolist() == [False, True, False, True, False, True]


def test_row_writer_names_rows_it_was_not_set_up_for():
    q = QUANTIZERS["nvfp4-row"]
    x = torch.randn(2, 3, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    row = torch.zeros(1, dtype=torch.long, device=DEVICE)
    writer = fused.RowWriter(x, q, _out(q, _buffers(q, 2, 3, 5, 64), 0, x.shape), row)
    other = torch.randn(2, 1, 3, 64, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)  # other strides
    assert not writer.fits(other, q, row)
    assert not writer.fits(x, q, torch.zeros_like(row))  # another row tensor
    assert not writer.fits(x, QUANTIZERS["mxfp4"], row)
    with pytest.raises(ValueError, match="set up for rows"):
        writer(other)
    with pytest.raises(ValueError, match="writes_at"):  # a per-tensor amax is not written at the device row
        fused.RowWriter(x, QUANTIZERS["nvfp4-tensor"], _out(q, _buffers(q, 2, 3, 5, 64), 0, x.shape), row)


def test_static_cache_keeps_one_writer_per_store(writes):
    """A static cache's decode steps reuse each K/V store's ``RowWriter``; a batch selection drops it (new buffers),
    and the rows stored after it still equal the growing cache's."""
    q = QUANTIZERS["nvfp4-row"]
    kv = steps(2, 3, 64, 5, torch.bfloat16, DEVICE, seed=8)
    static, grown = kv_cache.FP4KVCache(1, q, static_rows=16), kv_cache.FP4KVCache(1, q)
    static.update(*kv[0], 0)
    grown.update(*kv[0], 0)
    made = []
    for i, (k, v) in enumerate(kv[1:]):
        if i == 2:
            index = torch.tensor([1, 0], device=DEVICE)
            static.layers[0].batch_select_indices(index)
            grown.layers[0].batch_select_indices(index)
        static.decode_position().fill_(3 + i)
        static.update(k, v, 0)
        static.advance(1)
        grown.update(k, v, 0)
        made.append(static.layers[0]._rows["kv_k"]._writer[0])
    assert made[0] is made[1] and made[2] is made[3] and made[1] is not made[2]
    for site in ("kv_k", "kv_v"):
        assert_same_fp4(static.layers[0].fp4_history(site), grown.layers[0].fp4_history(site))


@pytest.mark.parametrize(("dtype", "d"), [(torch.bfloat16, 64), (torch.float16, 128)], ids=["bf16-64", "fp16-128"])
@pytest.mark.parametrize("policy", list(QUANTIZERS))
@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_prefill_reads_its_rows_from_the_quantize_pass(policy, dtype, d, static, monkeypatch):
    """A prefill's history (nothing stored before) comes out of the quantize pass itself (``fused.quantize``
    with ``deq_dtype``), no dequantize kernel after it: the same bits as dequantizing the rows it stored
    (``ops.dequantize``), for edge rows (ties, zeros, subnormal, huge) and NaN/Inf rows too; a second chunk
    dequantizes the stored history as before."""
    q = QUANTIZERS[policy]
    odd = torch.stack([t.transpose(1, 2).reshape(-1, d) for t in _odd_tokens(dtype, d)])  # [2, B*H, D]
    x = odd.reshape(2, 2, 8, d).permute(1, 2, 0, 3)  # [B=2, H=8, t=2, D], not contiguous
    dequantized = []
    real = kv_rows.FP4Rows.dequantize
    monkeypatch.setattr(kv_rows.FP4Rows, "dequantize",
                        lambda self, *a, **k: dequantized.append(1) or real(self, *a, **k))
    cache = kv_cache.FP4KVCache(1, q, static_rows=16 if static else None)
    keys, values = cache.update(x, x.flip(0), 0)
    assert not dequantized
    for site, got in (("kv_k", keys), ("kv_v", values)):
        want = kv_rows.kernel_dequantize(cache.layers[0].fp4_history(site), dtype, kernel="auto")
        assert got.shape == x.shape and same_bits(got, want), site
    if not static:  # (a static cache takes one prefill, then one-token decode writes)
        more = random_rows((2, 8, 3, d), dtype, torch.Generator().manual_seed(9)).to(DEVICE)
        keys, _ = cache.update(more, more, 0)
        assert len(dequantized) == 2 and keys.shape[2] == 5
        want = kv_rows.kernel_dequantize(cache.layers[0].fp4_history("kv_k"), dtype, kernel="auto")
        assert same_bits(keys, want)


@pytest.mark.parametrize(("dtype", "d"), [(torch.float32, 64), (torch.bfloat16, 40)], ids=["fp32-64", "bf16-40"])
@pytest.mark.parametrize("policy", list(QUANTIZERS))
def test_prefill_read_equals_the_reference_cache(policy, dtype, d):
    """The one-pass prefill read for fp32 rows and for a head_dim that is not a whole number of blocks (the element
    kernel, padded blocks): the reference cache's history, bit for bit."""
    q = QUANTIZERS[policy]
    x = random_rows((2, 5, 3, d), dtype, torch.Generator().manual_seed(10)).to(DEVICE).transpose(1, 2)
    got = kv_cache.FP4KVCache(1, q).update(x, x, 0)
    want = kv_cache.FP4KVCache(1, q, kernel="reference").update(x, x, 0)
    assert all(same_bits(a, b) for a, b in zip(got, want, strict=True))
