"""Host side of the Triton quantize kernel: RNE quantize (+ fused compact record), guided quantize,
fused fake-quant forward with its STE backward. Needs Triton and CUDA tensors; ``ops`` dispatches here.
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import block as ref_block
from ..formats.nvfp4 import FORMAT as NVFP4_FORMAT
from ..formats.quantizer import Quantizer, ste_backward
from ..formats.registry import FORMATS, get_format
from ..formats.tensor import CompactGuidance, FP4Tensor, FullGuidance
from . import quant_triton as qk
from .checks import FiniteCounter


def check_x(x: torch.Tensor, what: str = "x") -> None:
    """The reference's input checks, except the NaN/Inf scan (the kernel counts those)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ref_block.FLOAT_DTYPES:
        raise TypeError(f"{what}.dtype={x.dtype} is not one of {ref_block.FLOAT_DTYPES}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{what} needs at least one dim with a non-empty last dim, got shape {tuple(x.shape)}")


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as [M, K] with unit stride along K (a copy only when needed)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def _rows(t: torch.Tensor, lead: tuple) -> torch.Tensor:
    """Kernel output rows [M, W] as [*lead, W] (also for M = 0)."""
    return t.reshape(*lead, t.shape[-1])


def _err(check_finite, device) -> torch.Tensor | None:
    """The NaN/Inf counter the kernels add into: a fresh one (``True``: checked now), the site's deferred
    ``FiniteCounter``, or None (unchecked)."""
    if isinstance(check_finite, FiniteCounter):
        return check_finite.tensor(device)
    return torch.zeros(1, dtype=torch.int64, device=device) if check_finite else None


def _raise_if_bad(err: torch.Tensor | None, x: torch.Tensor, check_finite) -> None:
    """Checked now (one host sync) unless the check is deferred to a ``FiniteCounter`` (then marked: the kernel
    that counts into it is queued)."""
    if isinstance(check_finite, FiniteCounter):
        check_finite.mark()
    elif err is not None and int(err.item()) != 0:
        ref_block.check_input(x)  # raises the reference's NonFiniteError (with the first bad index)


def _global_amax(x2d, quantizer: Quantizer, global_amax, x, err, check_finite=True, stacked: bool = False):
    """(g_mode, g tensor or None, g as stored in the FP4Tensor or None) for an own-scale quantize.

    A given amax is checked (finite, > 0) at once, or into the deferred counter (no host sync). ``stacked``
    (NVFP4 per tensor): each x[j] takes its own amax, computed here as one value per row of x2d."""
    if quantizer.fmt != "nvfp4":
        get_format("mxfp4").global_amax(x, global_amax=global_amax, per_row=False)  # raises if given
        return qk.G_NONE, None, None
    if stacked:
        g = qk.absmax_rows(x2d, x.shape[0], err)
        return qk.G_ROW_GIVEN, g, g.reshape(*x.shape[:-1], 1)
    if global_amax is not None:
        deferred = isinstance(check_finite, FiniteCounter)
        g = NVFP4_FORMAT.global_amax(x, global_amax=global_amax, per_row=quantizer.per_row,
                                     check_values=not deferred)
        if deferred:  # not finite and > 0 (NaN fails both comparisons): 4 launches, where isfinite alone takes 4
            check_finite.add_bad(~((g > 0) & (g < float("inf"))))
        return (qk.G_SCALAR if g.dim() == 0 else qk.G_ROW_GIVEN), g.reshape(-1).contiguous(), g
    if quantizer.per_row:
        return qk.G_ROW_COMPUTE, None, None
    g = qk.absmax(x2d, err)
    return qk.G_SCALAR, g.reshape(1), g


def quantize(x, quantizer: Quantizer, *, global_amax=None, record: bool = False, write_codes: bool = True,
             deq_dtype=None, want_mask: bool = False, check_finite: bool | FiniteCounter = True,
             out: FP4Tensor | None = None, out_row: torch.Tensor | None = None, stacked: bool = False):
    """RNE quantize with the quantizer's own scales.

    ``stacked`` (``ops.fake_quantize``'s): x [S, ..., K] holds S tensors, each with its own per-tensor amax
    (stored per row, [S, ..., 1]).

    ``check_finite``: True raises ``NonFiniteError`` here (one host sync), a ``FiniteCounter`` counts NaN/Inf
    on the device for a later ``checks.raise_if_bad`` (their dequantized values stay NaN/Inf), False skips.
    ``out``: an FP4Tensor of x's shape and format whose codes, scales and (NVFP4) per-row amax [..., 1] are views
    to write in place, rows at one common step (``quant_triton.into_step``: e.g. one position of the KV cache's
    ``[B, H, capacity, ...]`` buffers); the quantize kernel writes them (a per-tensor or given amax is copied into
    out's amax). The returned FP4Tensor holds out's views, with the global amax it has without ``out``.
    ``out_row`` (int64 [1] on the device; NVFP4 per-row or MXFP4, rows the pair kernel takes: ``writes_at``):
    out's row r takes x's row r at ``out_row[0]`` rows past out's start (a static KV cache's decode position,
    read by the kernel: nothing on the host changes with it).
    Returns (FP4Tensor or None when not ``write_codes``, CompactGuidance or None, raw outputs by name).
    """
    check_x(x)
    x2d = rows_of(x)
    into = None if out is None else _into(out, x, quantizer, write_codes and deq_dtype is None and not want_mask)
    if out_row is not None and (out is None or global_amax is not None or not writes_at(x, quantizer)):
        raise ValueError("out_row needs out=, no global_amax, and rows writes_at() takes (NVFP4 per row or MXFP4, "
                         f"RNE, bf16/fp16/fp32 rows of whole blocks); got quantizer {quantizer}, x {x.dtype} "
                         f"{tuple(x.shape)}")
    if stacked and (global_amax is not None or quantizer.per_row or x.dim() < 2 or out is not None):
        raise ValueError("stacked needs x [S, ..., K] (dim >= 2) and a per-tensor quantizer without global_amax "
                         f"or out=, got x {tuple(x.shape)}, {quantizer}, global_amax "
                         f"{'given' if global_amax is not None else None}, out {'given' if out is not None else None}")
    err = _err(check_finite, x.device)
    g_mode, g, g_store = _global_amax(x2d, quantizer, global_amax, x, err, check_finite, stacked)
    own_count = (g_mode == qk.G_SCALAR and global_amax is None) or (stacked and g_mode == qk.G_ROW_GIVEN)
    if into is not None and g_mode != qk.G_ROW_COMPUTE:
        into.pop("g", None)  # the kernel writes no amax: copied below
    fmt = quantizer.format
    res = qk.run_quant(
        x2d, fmt=qk.fmt_id(quantizer.fmt, quantizer.scale_rule), block=fmt.block_size, mode=qk.RNE, g_mode=g_mode,
        g=g, write_codes=write_codes, write_scales=write_codes, write_bits=record, deq_dtype=deq_dtype,
        write_mask=want_mask,
        # the amax's pass counted NaN/Inf: this launch counts into a scratch counter, but still passes them through
        err=torch.zeros_like(err) if own_count and err is not None else err, into=into, into_row=out_row,
    )
    _raise_if_bad(err, x, check_finite)
    lead = tuple(x.shape[:-1])
    if g_mode == qk.G_ROW_COMPUTE:
        g_store = res["g"].reshape(*lead, 1) if out is None else out.global_amax
    elif out is not None and g_store is not None:
        out.global_amax.copy_(g_store)  # per tensor (broadcast) or given per row
    if not write_codes:
        return None, None, res
    if out is not None:
        t = dataclasses.replace(out, global_amax=g_store)
    else:
        t = FP4Tensor(
            codes=_rows(res["codes"], lead), block_scales=_rows(res["scales"], lead).view(fmt.scale_dtype),
            global_amax=g_store, shape=tuple(x.shape), fmt=quantizer.fmt,
        )
    rec = None
    if record:
        rec = CompactGuidance(mantissa_bits=_rows(res["bits"], lead), block_scales=t.block_scales,
                              global_amax=t.global_amax, shape=t.shape, fmt=t.fmt)
    return t, rec, res


class RowWriter:
    """``quantize(x, quantizer, check_finite=False, out=out, out_row=out_row)`` kept for repeated calls: a static KV
    cache writes one token per layer and step into the same buffer views at a device row. The checks and the launch
    arguments are those of the first call (``x``), so a call costs about one Triton launch of host time. ``fits``
    says whether other rows can take the kept launch; calling it with rows that do not raises ``ValueError``.
    ``check_finite``: a ``FiniteCounter`` the kernel counts NaN/Inf rows into (``quantize``'s deferred check; its
    tensor must stay the one it holds now), or None (unchecked)."""

    def __init__(self, x: torch.Tensor, quantizer: Quantizer, out: FP4Tensor, out_row: torch.Tensor,
                 check_finite: FiniteCounter | None = None):
        check_x(x)
        if not self.takes(x, quantizer):
            raise ValueError("RowWriter needs rows writes_at() takes (NVFP4 per row or MXFP4, RNE, bf16/fp16/fp32 "
                             f"rows of whole blocks) that are a view of x as rows; got quantizer {quantizer}, x "
                             f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
        x2d = rows_of(x)
        into = _into(out, x, quantizer, True)
        m, k = x2d.shape
        fmt = quantizer.format
        nb = k // fmt.block_size
        step = qk.into_step(into, m, {"codes": nb * fmt.block_size // 2, "scales": nb, "g": 1}, x.device)
        g_mode = qk.G_ROW_COMPUTE if quantizer.fmt == "nvfp4" else qk.G_NONE
        from . import pair_launch

        spare = torch.empty(1, dtype=torch.uint8, device=x.device)
        if check_finite is not None and not isinstance(check_finite, FiniteCounter):
            raise TypeError(f"check_finite must be a FiniteCounter or None, got {type(check_finite).__name__}")
        self.check_finite = check_finite
        err = self._err = None if check_finite is None else check_finite.tensor(x.device)
        self._run = pair_launch.prepare(
            x2d, into, g=into.get("g"), scales_in=None, guide=None, err=err, spare=spare,
            fmt=qk.fmt_id(quantizer.fmt, quantizer.scale_rule), block=fmt.block_size, mode=qk.RNE, g_mode=g_mode,
            write_codes=True, write_scales=True, write_bits=False, write_mask=False, fast_div=qk.FAST_DIV,
            out_step=step, out_row=out_row)
        self.quantizer, self.out_row, self.m, self.k = quantizer, out_row, m, k
        self._layout = self._layout_of(x)
        self._align = 2 * x.element_size()

    @staticmethod
    def takes(x: torch.Tensor, quantizer: Quantizer) -> bool:
        """Whether a writer can be set up for rows x: ``writes_at`` holds and x reads as rows without a copy."""
        if not writes_at(x, quantizer):
            return False
        try:
            x.view(-1, x.shape[-1])
        except RuntimeError:
            return False
        return True

    @staticmethod
    def _layout_of(x: torch.Tensor) -> tuple:
        return tuple(x.shape), x.stride(), x.dtype, x.device

    def fits(self, x: torch.Tensor, quantizer: Quantizer, out_row: torch.Tensor,
             check_finite: FiniteCounter | None = None) -> bool:
        """Whether ``self(x)`` is ``quantize(x, quantizer, out=<this writer's out>, out_row=out_row,
        check_finite=check_finite)``: the same quantizer, row tensor and counter, and x laid out like the first rows
        (shape, strides, dtype, device, alignment)."""
        return (out_row is self.out_row and check_finite is self.check_finite
                and (quantizer is self.quantizer or quantizer == self.quantizer)
                and self._layout_of(x) == self._layout and x.data_ptr() % self._align == 0)

    def __call__(self, x: torch.Tensor) -> None:
        if self._layout_of(x) != self._layout or x.data_ptr() % self._align:
            raise ValueError(f"RowWriter was set up for rows {self._layout[:3]} on {self._layout[3]}, "
                             f"{self._align}-byte aligned; got {tuple(x.shape)} strides {x.stride()} {x.dtype} on "
                             f"{x.device} at {x.data_ptr()}")
        c = self.check_finite
        if c is not None and c.tensor(x.device) is not self._err:
            raise ValueError(f"RowWriter's counter {c.label!r} holds another tensor than at setup (moved to another "
                             "device?): set up a new writer")
        self._run(x.view(self.m, self.k))
        if c is not None:
            c.mark()


def writes_at(x: torch.Tensor, quantizer: Quantizer) -> bool:
    """Whether ``quantize(x, quantizer, out=..., out_row=...)`` applies: RNE, no per-tensor amax (NVFP4 per row,
    or MXFP4: the kernel writes every output at the device row), and rows the pair kernel takes."""
    own_rows = quantizer.fmt != "nvfp4" or quantizer.per_row
    return (quantizer.rounding == "rne" and own_rows
            and qk.pair_ok(rows_of(x), quantizer.format.block_size, None))


def _into(out: FP4Tensor, x, quantizer: Quantizer, codes_only: bool) -> dict[str, torch.Tensor]:
    """``quantize``'s ``out`` as ``run_quant``'s ``into`` rows: codes, scales (uint8) and the amax as [M, width]
    views. Raises ``ValueError`` naming what does not fit."""
    if not codes_only:
        raise ValueError("out= needs write_codes=True, deq_dtype=None and want_mask=False")
    fmt = quantizer.format
    if not isinstance(out, FP4Tensor) or out.fmt != quantizer.fmt or tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must be an FP4Tensor of fmt={quantizer.fmt!r}, shape {tuple(x.shape)}, got "
                         f"{type(out).__name__} {getattr(out, 'fmt', None)!r} {getattr(out, 'shape', None)}")
    if out.block_scales.dtype != fmt.scale_dtype:
        raise ValueError(f"out.block_scales.dtype={out.block_scales.dtype} must be {fmt.scale_dtype}")
    amax = out.global_amax
    if (amax is None) != (quantizer.fmt != "nvfp4") or (amax is not None and (
            tuple(amax.shape) != (*x.shape[:-1], 1) or amax.dtype != torch.float32)):
        want = f"float32 {[*x.shape[:-1], 1]}" if quantizer.fmt == "nvfp4" else "None"
        got = None if amax is None else f"{amax.dtype} {list(amax.shape)}"
        raise ValueError(f"out.global_amax must be {want} (per-row storage) for fmt={quantizer.fmt!r}, got {got}")
    rows = {"codes": out.codes, "scales": out.block_scales.view(torch.uint8)}
    if amax is not None:
        rows["g"] = amax
    for name, t in rows.items():
        try:
            rows[name] = t.view(-1, t.shape[-1])
        except RuntimeError:
            raise ValueError(f"out's {name} (shape {list(t.shape)}, strides {t.stride()}) are not rows of one "
                             "stride") from None
    return rows


def guided(x, guidance, *, write_codes: bool = True, deq_dtype=None, want_mask: bool = False,
           check_finite: bool | FiniteCounter = True):
    """Guided quantize toward ``guidance`` with its scales (``check_finite``: as ``quantize``).
    Returns (FP4Tensor | None, outputs)."""
    check_x(x)
    fmt = get_format(getattr(guidance, "fmt", "nvfp4"))
    if fmt.name not in FORMATS:  # (the kernel knows NVFP4 and MXFP4 only: fmt_id would take it for MXFP4)
        raise ValueError(f"the Triton guided quantize takes {FORMATS} records, got fmt={fmt.name!r} "
                         "(ops.guided_quantize runs its reference)")
    ref_block.check_guidance(fmt, x, guidance)
    x2d = rows_of(x)
    dev = x.device
    m = x2d.shape[0]
    full = isinstance(guidance, FullGuidance)
    payload = guidance.codes if full else guidance.mantissa_bits
    scales = guidance.block_scales.to(dev, non_blocking=True).view(torch.uint8)
    scales = scales.reshape(m, scales.shape[-1]).contiguous()
    g_mode, g = qk.G_NONE, None
    if guidance.global_amax is not None:
        ga = guidance.global_amax.to(dev, non_blocking=True)
        g_mode, g = (qk.G_SCALAR if ga.dim() == 0 else qk.G_ROW_GIVEN), ga.float().reshape(-1).contiguous()
    err = _err(check_finite, dev)
    out = qk.run_quant(
        x2d, fmt=qk.fmt_id(fmt.name), block=fmt.block_size, mode=qk.GUIDED_FULL if full else qk.GUIDED_COMPACT,
        g_mode=g_mode, g=g, scales_in=scales,
        guide=payload.to(dev, non_blocking=True).reshape(m, payload.shape[-1]).contiguous(),
        write_codes=write_codes, write_scales=False, deq_dtype=deq_dtype, write_mask=want_mask, err=err,
    )
    _raise_if_bad(err, x, check_finite)
    t = None
    if write_codes:
        lead = tuple(x.shape[:-1])
        t = FP4Tensor(codes=_rows(out["codes"], lead), block_scales=guidance.block_scales,
                      global_amax=guidance.global_amax, shape=tuple(x.shape), fmt=fmt.name)
    return t, out


def fake_quantize(x, quantizer: Quantizer, *, guidance=None, global_amax=None,
                  check_finite: bool | FiniteCounter = True, stacked: bool = False):
    """Quantize-dequantize in one pass (guided if ``guidance``) with the quantizer's STE backward.
    ``stacked``: as ``quantize``'s."""
    return _FakeQuant.apply(x, quantizer, guidance, global_amax, check_finite, stacked)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, quantizer: Quantizer, guidance, global_amax, check_finite, stacked):
        xd = x.detach()
        clip = quantizer.ste_clip
        if guidance is not None:
            ref_block.check_guidance(quantizer.format, xd, guidance)  # the quantizer's format, as the reference
            _, out = guided(xd, guidance, write_codes=False, deq_dtype=x.dtype, want_mask=clip,
                            check_finite=check_finite)
        else:
            _, _, out = quantize(xd, quantizer, global_amax=global_amax, write_codes=False, deq_dtype=x.dtype,
                                 want_mask=clip, check_finite=check_finite, stacked=stacked)
        ctx.ste_clip = clip
        if clip:
            ctx.save_for_backward(out["mask"].view(torch.bool).reshape(x.shape))
        return out["deq"].reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return (*ste_backward(ctx, grad), None)  # (none for ``stacked``)
