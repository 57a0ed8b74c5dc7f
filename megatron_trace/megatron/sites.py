"""Quantize the rows of one activation site: guided where a row has a valid record, own rounding elsewhere.

All functions take rows ``x`` [N, K] (blocks along K) and return the fake-quantized rows in
``x.dtype`` with a straight-through gradient (see ``formats.Quantizer.fake_quantize``).
``kernel`` (``TraceConfig.kernel``: auto | reference | triton) picks the implementation of the
fake-quant through ``kernels.fake_quantize`` (bit-identical results; Triton only for CUDA tensors).
"""

from __future__ import annotations

import torch

from ..config import TraceConfig
from ..formats import FP4Tensor, Quantizer
from ..kernels import abs_max, fake_quantize
from ..kernels.checks import FiniteCounter
from .rows import RowGuidance, take


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, value, inside):
        ctx.save_for_backward(inside)
        return value

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return (grad if inside is None else grad * inside.to(grad.dtype)), None, None


def straight_through(x: torch.Tensor, value: torch.Tensor, inside: torch.Tensor | None = None) -> torch.Tensor:
    """``value`` in the forward; in the backward the identity gradient to ``x``, zero where ``inside`` (bool, x's
    shape) is False (``Quantizer.ste_clip``)."""
    return _StraightThrough.apply(x, value.detach(), inside)


def safe_amax(amax: torch.Tensor | None) -> torch.Tensor | None:
    """A given NVFP4 amax must be > 0; an all-zero row quantizes to zeros with any amax."""
    return None if amax is None else torch.where(amax > 0, amax, torch.ones_like(amax))


def _own_amax(quantizer: Quantizer, x: torch.Tensor, global_amax):
    """The amax for the own rounding: given, or per tensor over *all* rows (also for a subset of rows)."""
    if global_amax is None and quantizer.fmt == "nvfp4" and not quantizer.per_row:
        global_amax = abs_max(x)
    return safe_amax(global_amax)


def _rows_of(amax, index):
    return amax if amax is None or amax.dim() == 0 else amax.index_select(0, index)


def _split(valid: torch.Tensor):
    return valid.nonzero().squeeze(1), (~valid).nonzero().squeeze(1)


def empty_rows(quantizer: Quantizer, x: torch.Tensor) -> FP4Tensor:
    """The FP4 tensor of zero rows [0, K] (an expert-parallel rank can receive no tokens)."""
    fmt = quantizer.format
    kp = -(-x.shape[-1] // fmt.block_size) * fmt.block_size
    amax = None
    if quantizer.fmt == "nvfp4":
        amax = torch.zeros(0, 1, device=x.device) if quantizer.per_row else torch.zeros((), device=x.device)
    return FP4Tensor(
        codes=torch.zeros(0, kp // 2, dtype=torch.uint8, device=x.device),
        block_scales=torch.zeros(0, kp // fmt.block_size, dtype=fmt.scale_dtype, device=x.device),
        global_amax=amax, shape=(0, x.shape[-1]), fmt=quantizer.fmt,
    )


def finite_checks(config: TraceConfig, label: str, sites) -> dict[str, bool | FiniteCounter]:
    """Per site, what its quantize calls pass as ``check_finite`` (``TraceConfig.finite_check``): a deferred
    counter named ``"{label} {site}"``, or True (checked in the call)."""
    if config.finite_check == "sync":
        return {s: True for s in sites}
    return {s: FiniteCounter(f"{label} {s}") for s in sites}


def relabel(checks: dict, label: str) -> None:
    for site, c in checks.items():
        if isinstance(c, FiniteCounter):
            c.label = f"{label} {site}"


def quantize_rows(
    quantizer: Quantizer, x: torch.Tensor, guidance: RowGuidance | None = None, *, global_amax=None,
    kernel: str = "reference", check_finite: bool | FiniteCounter = True,
) -> torch.Tensor:
    """Fake-quantize rows ``x`` [N, K]; rows with ``guidance.valid`` use the record (guided rounding), the
    others the trainer's own rounding. No host sync: with ``guidance.all_valid`` one guided pass, else both
    passes over all rows and a per-row select (rows are quantized independently, so each row's bits are those
    of quantizing it alone). ``check_finite``: see ``kernels.fused.quantize`` (the reference checks at once)."""
    if x.shape[0] == 0:
        return x.clone()
    fq = lambda **kw: fake_quantize(x, quantizer, kernel=kernel, check_finite=check_finite, **kw)  # noqa: E731
    if guidance is None:
        return fq(global_amax=safe_amax(global_amax))
    guided = fq(guidance=guidance.record)
    if guidance.all_valid:  # every row guided (the usual case)
        return guided
    own = fq(global_amax=_own_amax(quantizer, x, global_amax))
    return torch.where(guidance.valid.to(x.device)[:, None], guided, own)


def quantize_rows_recorded(
    quantizer: Quantizer, x: torch.Tensor, guidance: RowGuidance | None = None, *, global_amax=None
) -> tuple[torch.Tensor, FP4Tensor]:
    """Like ``quantize_rows`` (the same values and gradient, ``ste_clip`` included) but also returns the FP4
    rows used (for recording)."""
    xd = x.detach()
    if x.shape[0] == 0:
        return x.clone(), empty_rows(quantizer, x)
    if guidance is None or not bool(guidance.valid.any()):
        q, inside = quantizer.quantize_with_clip_mask(xd, global_amax=safe_amax(global_amax))
    else:
        amax = _own_amax(quantizer, x, global_amax)
        g, r = _split(guidance.valid)
        parts = [(g, *quantizer.quantize_with_clip_mask(xd.index_select(0, g), guidance=take(guidance, g).record))]
        if r.numel():
            parts.append((r, *quantizer.quantize_with_clip_mask(xd.index_select(0, r),
                                                                 global_amax=_rows_of(amax, r))))
        q = merge_rows([(i, rows) for i, rows, _ in parts], x.shape)
        inside = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        for i, _, mask in parts:
            inside.index_copy_(0, i, mask)
    return straight_through(x, q.dequantize(x.dtype), inside if quantizer.ste_clip else None), q


def merge_rows(parts: list[tuple[torch.Tensor, FP4Tensor]], shape) -> FP4Tensor:
    """One FP4Tensor [N, K] from row subsets ``(index, rows)`` that partition 0..N-1."""
    n = shape[0]
    first = parts[0][1]

    def merged(get):
        if get(first) is None:
            return None
        rows = [(i, get(p)) for i, p in parts]
        rows = [(i, t.reshape(1, 1).expand(i.numel(), 1) if t.dim() == 0 else t) for i, t in rows]
        out = rows[0][1].new_zeros((n, *rows[0][1].shape[1:]))
        for i, t in rows:
            out.index_copy_(0, i, t)
        return out

    scales = merged(lambda p: p.block_scales.view(torch.uint8)).view(first.block_scales.dtype)
    return FP4Tensor(
        codes=merged(lambda p: p.codes), block_scales=scales, global_amax=merged(lambda p: p.global_amax),
        shape=tuple(shape), fmt=first.fmt,
    )
