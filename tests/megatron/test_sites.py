"""One activation site's rows (``megatron.sites``): ``quantize_rows_recorded`` gives the values and gradient of
``quantize_rows`` (the fake-quant kernels), ``ste_clip`` included, and FP4 rows whose dequantization they are; partial
guidance, per-tensor amax over all rows, a given per-row amax and all-zero rows each take a path of their own."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.formats import Quantizer
from megatron_trace.kernels.checks import FiniteCounter
from megatron_trace.megatron.rows import RowGuidance
from megatron_trace.megatron.sites import empty_rows, finite_checks, quantize_rows, quantize_rows_recorded, relabel

N, K = 6, 64
QUANTIZERS = {
    "nvfp4_per_row": Quantizer(fmt="nvfp4", per_row=True, ste_clip=True),
    "nvfp4_per_tensor": Quantizer(fmt="nvfp4", ste_clip=True),
    "mxfp4": Quantizer(fmt="mxfp4", ste_clip=True),
}
VALID = {"none": None, "partial": [True, False, True, False, False, True], "all": [True] * N, "no_row": [False] * N}


def _rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 4
    x[0, 5] = 40.0  # the tensor's largest value, in a guided row: a per-tensor amax of the unguided rows alone differs
    x[3] = 0.0  # an all-zero row, unguided
    return x


def _guidance(quantizer, x, valid):
    """A rollout's record of slightly different rows, smaller: its scales clip some of the trainer's elements."""
    if valid is None:
        return None
    g = torch.Generator().manual_seed(4)
    rec = quantizer.quantize(x * 0.6 + 0.05 * torch.randn(x.shape, generator=g))
    return RowGuidance(rec.guidance(compact=False), torch.tensor(valid), all_valid=all(valid))


def _value_and_grad(fn, x):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    y = out[0] if isinstance(out, tuple) else out
    (y * torch.arange(1.0, y.numel() + 1).reshape(y.shape)).sum().backward()
    return y.detach(), x.grad, out


@pytest.mark.parametrize("valid", VALID, ids=list(VALID))
@pytest.mark.parametrize("name", QUANTIZERS, ids=list(QUANTIZERS))
def test_recorded_rows_equal_the_kernels_values_and_gradient(name, valid):
    quantizer, x = QUANTIZERS[name], _rows()
    rows = _guidance(quantizer, x, VALID[valid])
    y, grad, _ = _value_and_grad(lambda t: quantize_rows(quantizer, t, rows), x)
    y_rec, grad_rec, (_, q) = _value_and_grad(lambda t: quantize_rows_recorded(quantizer, t, rows), x)
    assert torch.equal(y_rec, y) and torch.equal(grad_rec, grad)
    assert torch.equal(q.dequantize(x.dtype), y)
    assert torch.all(y[3] == 0)  # the all-zero row
    if valid in ("partial", "all"):  # the record's smaller scales clip: ste_clip's gradient is zero there
        assert (grad == 0).any()


def test_a_given_per_row_amax_is_taken_row_by_row():
    """Per-tensor amax under expert parallelism: each row comes with its source rank's amax ([N, 1]), and each
    unguided row uses its own; a zero amax (an all-zero row) quantizes to zeros, not NaN."""
    quantizer, x = QUANTIZERS["nvfp4_per_tensor"], _rows()
    amax = x.abs().amax(dim=1, keepdim=True) * torch.linspace(1.0, 3.0, N)[:, None]
    rows = _guidance(quantizer, x, VALID["partial"])
    want = torch.stack([quantizer.quantize(x[i:i + 1], global_amax=amax[i:i + 1]).dequantize(x.dtype)[0]
                        if amax[i] > 0 else torch.zeros(K) for i in range(N)])
    for r in (None, rows):
        y, _ = quantize_rows_recorded(quantizer, x, r, global_amax=amax)
        own = ~r.valid if r is not None else torch.ones(N, dtype=torch.bool)
        assert torch.equal(y[own], want[own])
        assert torch.equal(quantize_rows(quantizer, x, r, global_amax=amax), y)
    assert torch.all(y[3] == 0) and amax[3] == 0


@pytest.mark.parametrize("name", QUANTIZERS, ids=list(QUANTIZERS))
def test_no_rows(name):
    """An expert-parallel rank can receive no tokens: [0, K] rows, and FP4 rows shaped as those of one real row."""
    quantizer = QUANTIZERS[name]
    x = torch.randn(3, 40)  # (40: not a multiple of the block size; the FP4 rows are padded)
    assert quantize_rows(quantizer, x[:0]).shape == (0, 40)
    y, q = quantize_rows_recorded(quantizer, x[:0])
    one = quantizer.quantize(x[:1])
    assert y.shape == (0, 40) and q.shape == (0, 40) and q.fmt == one.fmt
    assert q.codes.shape[1:] == one.codes.shape[1:] and q.codes.dtype == one.codes.dtype
    assert q.block_scales.shape[1:] == one.block_scales.shape[1:] and q.block_scales.dtype == one.block_scales.dtype
    assert (q.global_amax is None) == (one.global_amax is None)
    if one.global_amax is not None:
        assert q.global_amax.dim() == one.global_amax.dim() and q.global_amax.shape[1:] == one.global_amax.shape[1:]
    assert empty_rows(quantizer, x).codes.shape == (0, *one.codes.shape[1:])


def test_finite_checks_follow_the_config_and_relabel():
    sites = ("expert_fc1_in", "expert_fc2_in")
    assert finite_checks(TraceConfig(finite_check="sync"), "layer 2", sites) == {s: True for s in sites}
    checks = finite_checks(TraceConfig(finite_check="deferred"), "layer 2", sites)
    assert all(isinstance(c, FiniteCounter) for c in checks.values())
    assert [c.label for c in checks.values()] == ["layer 2 expert_fc1_in", "layer 2 expert_fc2_in"]
    relabel(checks, "layer 5")
    assert [c.label for c in checks.values()] == ["layer 5 expert_fc1_in", "layer 5 expert_fc2_in"]
