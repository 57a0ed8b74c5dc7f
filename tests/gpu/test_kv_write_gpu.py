"""The FP4 KV cache's decode write on CUDA (skipped elsewhere): one Triton quantize per K or V writes the token's
codes, scales and amax straight into the cache buffers, and stores, returns and records the bits of the reference
cache (``kernel="reference"``: quantize, then copy), ``torch.equal``; across a buffer growth (``MIN_GROWTH``
= 16 here), with batch forks, NVFP4 per-row / per-tensor amax and MXFP4, bf16 / fp16, head_dim 64 / 128, and for
NaN/Inf and extreme rows the Triton quantize's bits without ``out=``. ``tests/kernels/test_kv_write.py`` runs the same
checks in Triton's CPU interpreter."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
    pytest.skip("needs CUDA and triton", allow_module_level=True)

from megatron_trace.rollout import kv_cache, kv_rows  # noqa: E402

from ..kernels._gpu import edge_rows  # noqa: E402
from ..kernels._kv_write import (  # noqa: E402
    QUANTIZERS,
    assert_same_runs,
    assert_tokens_stored,
    count_out_writes,
    run,
    steps,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _small_growth(monkeypatch):
    """The buffers grow every 16 decode steps (not 256): the growth is crossed in a few dozen steps (calls 4 and 5
    of session 12 ran out of their time limit with 264 steps per case)."""
    monkeypatch.setattr(kv_rows, "MIN_GROWTH", 16)


@pytest.fixture
def writes(monkeypatch):
    """The ``fused.quantize`` calls with ``out=`` (the in-place decode writes), counted."""
    return count_out_writes(monkeypatch)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("policy", list(QUANTIZERS))
def test_decode_writes_equal_the_reference_cache_across_growth(policy, dtype, d, writes):
    n = 2 * kv_rows.MIN_GROWTH + 8  # the buffers (prefill + MIN_GROWTH slots, rounded up to 16) grow in the decode
    kv = steps(8, 4, d, n, dtype, DEV, seed=d)
    compact = policy != "mxfp4"  # compact and full records, both from the stored history
    select = (n // 2, torch.tensor([3, 0, 0, 7, 5, 1, 2, 6], device=DEV))
    got = run(QUANTIZERS[policy], kv, compact=compact, select=select)
    assert sum(writes) == 2 * n
    assert_same_runs(got, run(QUANTIZERS[policy], kv, kernel="reference", compact=compact, select=select))


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full"])
def test_records_equal_the_reference(compact, writes):
    kv = steps(4, 8, 128, 40, torch.bfloat16, DEV, seed=5)
    got = run(QUANTIZERS["nvfp4-row"], kv, compact=compact)
    assert sum(writes) == 2 * 40
    assert_same_runs(got, run(QUANTIZERS["nvfp4-row"], kv, kernel="reference", compact=compact))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("policy", ["nvfp4-row", "mxfp4"])
def test_nonfinite_and_extreme_rows_equal_the_triton_quantize(policy, d, writes):
    q = QUANTIZERS[policy]
    e = edge_rows(torch.bfloat16)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0]).repeat(16).bfloat16()
    rows = torch.cat([e, bad[None], -bad[None].roll(1, 1), e.flip(0)] * 4)[:64]
    rows = torch.cat([rows] * (d // 64), 1).to(DEV)
    toks = [rows.roll(i, 0).reshape(4, 1, 16, d).transpose(1, 2) for i in range(3)]  # [B, H, 1, D]
    cache = kv_cache.FP4KVCache(1, q, fused_decode=True)
    pre = torch.randn(4, 3, 16, d, device=DEV).bfloat16().transpose(1, 2)
    cache.update(pre, pre, 0)
    for t in toks:
        cache.update(t, t, 0)
    assert sum(writes) == 2 * len(toks)
    assert_tokens_stored(cache, toks, q, 3)
