"""Decode steps through an ``FP4KVCache`` and the checks that its in-place token write stores what the old path
(quantize, then copy into the buffers) stores: shared by ``test_kv_write`` (CPU interpreter) and the CUDA test."""

from __future__ import annotations

import dataclasses

import torch

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import compact_guidance
from megatron_trace.rollout.kv_cache import FP4KVCache
from megatron_trace.rollout.recorder import GuidanceRecorder

from ._gpu import assert_same_fp4, random_rows, same_bits

SITES = ("kv_k", "kv_v")
QUANTIZERS = {"nvfp4-row": Quantizer("nvfp4", per_row=True), "mxfp4": Quantizer("mxfp4"),
              "nvfp4-tensor": Quantizer("nvfp4")}


def _map(t, fn):
    return dataclasses.replace(t, **{f.name: fn(getattr(t, f.name)) for f in dataclasses.fields(t)
                                     if isinstance(getattr(t, f.name), torch.Tensor)})


def count_out_writes(monkeypatch) -> list[bool]:
    """Spy on ``fused.quantize`` and ``fused.RowWriter``'s calls: one entry per call, True for the in-place decode
    writes (``out=``; a kept static decode write)."""
    from megatron_trace.kernels import fused  # imports Triton

    calls = []
    real, real_write = fused.quantize, fused.RowWriter.__call__

    def spy(*args, **kwargs):
        calls.append(kwargs.get("out") is not None)
        return real(*args, **kwargs)

    def spy_write(self, x):
        calls.append(True)
        return real_write(self, x)

    monkeypatch.setattr(fused, "quantize", spy)
    monkeypatch.setattr(fused.RowWriter, "__call__", spy_write)
    return calls


def heads_major(b: int, t: int, h: int, d: int, dtype, gen, device) -> torch.Tensor:
    """[B, H, t, D] as transformers passes K/V: a transpose of [B, t, H, D] (not contiguous)."""
    return random_rows((b, t, h, d), dtype, gen).to(device).transpose(1, 2)


def steps(b: int, h: int, d: int, n: int, dtype, device, seed: int = 0, prefill: int = 3) -> list:
    """(K, V) of a prefill of ``prefill`` tokens, then ``n`` one-token decode updates."""
    gen = torch.Generator().manual_seed(seed)
    return [(heads_major(b, t, h, d, dtype, gen, device), heads_major(b, t, h, d, dtype, gen, device))
            for t in [prefill] + [1] * n]


def run(quantizer: Quantizer, kv: list, *, kernel: str = "auto", compact: bool | None = True,
        select: tuple[int, torch.Tensor] | None = None):
    """Feed ``kv`` to a one-layer cache with a recorder of both sites, as ``generate`` does (``select``: (step,
    batch index) for a ``batch_select_indices`` of the cache and the recorder before that step). Returns (cache,
    {site: its records, read from the recorder at the end} or None without a recorder, what each update
    returned)."""
    b = kv[0][0].shape[0]
    rec = None if compact is None else GuidanceRecorder(b, {(0, s) for s in SITES}, compact=compact, kernel=kernel)
    cache = FP4KVCache(1, quantizer, recorder=rec, kernel=kernel)
    outs = []
    for i, (k, v) in enumerate(kv):
        if select is not None and i >= select[0]:
            if i == select[0]:
                cache.batch_select_indices(select[1])
                if rec is not None:
                    rec.select_rows(select[1])
            k, v = (t.transpose(1, 2).index_select(0, select[1]).transpose(1, 2) for t in (k, v))  # still views
        outs.append(cache.update(k, v, 0))
        if rec is not None:
            rec.end_step(torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device))
    records = None if rec is None else {s: rec.site_records((0, s)) for s in SITES}
    return cache, records, outs


def assert_same_runs(a, b) -> None:
    """Two ``run`` results store, record and return the same bits; the records are the stored history's."""
    (ca, ra, oa), (cb, rb, ob) = a, b
    for site in SITES:
        assert_same_fp4(ca.layers[0].fp4_history(site), cb.layers[0].fp4_history(site))
    for (ka, va), (kb, vb) in zip(oa, ob, strict=True):
        assert same_bits(ka, kb) and same_bits(va, vb)
    if ra is None:
        return
    for site in SITES:
        (x,), (y,) = ra[site], rb[site]  # one chunk: every position, from the cache
        assert_same_fp4(x, y)
        hist = _map(ca.layers[0].fp4_history(site), lambda t: t.transpose(1, 2))  # batch-major [B, T, H, ...]
        b, h, t, d = hist.shape
        hist = dataclasses.replace(hist, shape=(b, t, h, d))
        assert tuple(x.shape) == (b, t, h, d) and torch.equal(x.block_scales.view(torch.uint8).cpu(),
                                                      hist.block_scales.view(torch.uint8).cpu())
        payload = x.codes if hasattr(x, "codes") else x.mantissa_bits
        want = hist.codes if hasattr(x, "codes") else compact_guidance(hist, kernel="reference").mantissa_bits
        assert torch.equal(payload.cpu(), want.cpu())


def assert_tokens_stored(cache: FP4KVCache, toks: list, quantizer: Quantizer, first: int) -> None:
    """The cache's K rows first, first + 1, ... hold the Triton quantize (without ``out=``) of each token."""
    from megatron_trace.kernels import fused  # imports Triton

    hist = cache.layers[0].fp4_history("kv_k")
    for i, t in enumerate(toks):
        want = fused.quantize(t, quantizer, check_finite=False)[0]
        rows = slice(first + i, first + i + 1)
        assert torch.equal(hist.codes[:, :, rows].cpu(), want.codes.cpu())
        assert torch.equal(hist.block_scales[:, :, rows].view(torch.uint8).cpu(),
                           want.block_scales.view(torch.uint8).cpu())
        if want.global_amax is not None:
            assert torch.equal(hist.global_amax[:, :, rows].cpu().view(torch.int32),
                               want.global_amax.cpu().view(torch.int32))
