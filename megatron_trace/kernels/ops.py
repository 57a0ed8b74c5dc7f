"""Public FP4 ops with kernel selection: each runs the Triton twin on CUDA or the ``formats`` reference.

Both paths return the same bits (codes, scales, global amax, dequantized values); the tests check
that with ``torch.equal``. Triton modules are imported only when a Triton path is chosen.
"""

from __future__ import annotations

import torch

from ..formats import block, e2m1
from ..formats.quantizer import Quantizer
from ..formats.registry import FORMATS, get_format
from ..formats.sglang_kvfp4 import SGLangKVQuantizer
from ..formats.tensor import CompactGuidance, FP4Tensor, FullGuidance
from .dispatch import Kernel, select_kernel

_STOCHASTIC = "stochastic rounding has no Triton path (it draws torch random numbers)"


_KIND_NAMES = {Quantizer: "formats.Quantizer", SGLangKVQuantizer: "formats.sglang_kvfp4.SGLangKVQuantizer"}


def check_quantizer(quantizer, x, kinds=(Quantizer, SGLangKVQuantizer)) -> None:
    """``x`` a tensor and ``quantizer`` one of ``kinds`` (else a bare AttributeError on ``.device`` / ``.rounding``)."""
    if not isinstance(quantizer, kinds):
        names = " or ".join(_KIND_NAMES[k] for k in kinds)
        raise TypeError(f"quantizer must be a {names}, got {type(quantizer).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")


def _own(quantizer: Quantizer, x: torch.Tensor, kernel) -> Kernel:
    check_quantizer(quantizer, x, (Quantizer,))
    return select_kernel(kernel, x.device, unsupported=_STOCHASTIC if quantizer.rounding != "rne" else None)


def abs_max(x: torch.Tensor, start_dim: int = 0) -> torch.Tensor:
    """max|x| (float32) over the dims from ``start_dim`` on, shape ``x.shape[:start_dim]``: one read of x
    (``aminmax``), where ``x.float().abs().amax(...)`` writes and reads two full-size copies. Same value
    (negation and max are exact); a NaN in x gives NaN; no element gives 0 (as ``NVFP4Format.global_amax``: an EP
    rank without tokens)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():  # (int8's -(-128) is -128: amax 1 of [-128, 1])
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"abs_max needs a floating-point tensor, got {got}")
    if isinstance(start_dim, bool) or not isinstance(start_dim, int) or not -x.dim() <= start_dim <= x.dim():
        raise ValueError(f"start_dim={start_dim!r} must be an int in {-x.dim()}..{x.dim()} (x has shape "
                         f"{tuple(x.shape)})")
    # (not reshape(*x.shape[:start_dim], -1): ambiguous for no element, [0, -1])
    rows = x.detach().unsqueeze(-1) if start_dim == x.dim() else x.detach().flatten(start_dim)
    if rows.shape[-1] == 0:  # (aminmax: "Expected reduction dim 0 to have non-zero size")
        return torch.zeros(rows.shape[:-1], dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(rows, dim=-1)
    return torch.maximum(-lo, hi).float()


def quantize(x: torch.Tensor, quantizer: Quantizer, *, global_amax=None, kernel: str | Kernel = "auto",
             check_finite: bool = True) -> FP4Tensor:
    """``quantizer.quantize(x, global_amax=...)``; the Triton path is one pass (two for a per-tensor amax).

    ``check_finite=False`` skips the NaN/Inf check (and its host sync) on the Triton path; a ``checks.FiniteCounter``
    defers it (the kernel counts NaN/Inf into it, no host sync). The reference path always checks in the call.
    """
    if _own(quantizer, x, kernel) is Kernel.REFERENCE:
        return quantizer.quantize(x, global_amax=global_amax)
    from . import fused

    return fused.quantize(x, quantizer, global_amax=global_amax, check_finite=check_finite)[0]


def quantize_and_record(x: torch.Tensor, quantizer: Quantizer, *, global_amax=None, kernel: str | Kernel = "auto",
                        check_finite: bool = True) -> tuple[FP4Tensor, CompactGuidance]:
    """Quantize and emit the compact guidance record (mantissa bits) in the same pass (rollout side)."""
    if _own(quantizer, x, kernel) is Kernel.REFERENCE:
        q = quantizer.quantize(x, global_amax=global_amax)
        return q, q.guidance(compact=True)
    from . import fused

    q, rec, _ = fused.quantize(x, quantizer, global_amax=global_amax, record=True, check_finite=check_finite)
    return q, rec


def guided_quantize(x: torch.Tensor, guidance: FullGuidance | CompactGuidance, *, kernel: str | Kernel = "auto",
                    check_finite: bool = True) -> FP4Tensor:
    """Guided rounding toward a rollout record, with the record's scales (trainer side). A record of a
    record-only format (``"sglang_kvfp4"``) has no Triton path: ``"auto"`` runs its reference."""
    fmt = getattr(guidance, "fmt", "nvfp4")
    other = None if fmt in FORMATS else f"fmt={fmt!r} records have no Triton path (the reference runs them)"
    if select_kernel(kernel, x.device, unsupported=other) is Kernel.REFERENCE:
        return block.guided_quantize_with_z(get_format(fmt), x, guidance)[0]
    from . import fused

    return fused.guided(x, guidance, check_finite=check_finite)[0]


def fake_quantize(x: torch.Tensor, quantizer: Quantizer, *, guidance=None, global_amax=None,
                  kernel: str | Kernel = "auto", check_finite: bool = True, stacked: bool = False) -> torch.Tensor:
    """``quantizer.fake_quantize``: quantize-dequantize in x.dtype (guided when ``guidance``), STE backward.

    The Triton path reads x once and writes the result (and the STE mask when ``quantizer.ste_clip``).
    ``stacked``: x [S, ..., K] is S tensors (e.g. experts' weights), each fake-quantized as
    ``quantizer.fake_quantize(x[j])`` would: with its own per-tensor amax (NVFP4; MXFP4 has none). The Triton
    path takes three launches for all S (the amaxes, their rows, the fake-quant).
    """
    check_quantizer(quantizer, x)
    if stacked and quantizer.fmt == "nvfp4":
        if global_amax is not None or guidance is not None or quantizer.per_row or x.dim() < 2:
            raise ValueError("stacked needs x [S, ..., K] (dim >= 2), a per-tensor quantizer and no global_amax or "
                             f"guidance, got x {tuple(x.shape)}, {quantizer}")
    else:
        stacked = False  # MXFP4's blocks are independent: x[j] alone gives the same bits
    unsupported = _STOCHASTIC if quantizer.rounding != "rne" and guidance is None else None
    if quantizer.fmt not in FORMATS:  # (sglang_kvfp4.SGLangKVQuantizer: reference only, guided or not)
        unsupported = f"fmt={quantizer.fmt!r} has no Triton path (the reference runs it)"
    if select_kernel(kernel, x.device, unsupported=unsupported) is Kernel.REFERENCE:
        if stacked:
            global_amax = _stacked_amax(x)
        return quantizer.fake_quantize(x, guidance=guidance, global_amax=global_amax)
    from . import fused

    return fused.fake_quantize(x, quantizer, guidance=guidance, global_amax=global_amax, check_finite=check_finite,
                               stacked=stacked)


def _stacked_amax(x: torch.Tensor) -> torch.Tensor:
    """Per row [S, ..., 1], the amax of its x[j] (1 where that is 0: a given amax must be > 0, and an all-zero
    tensor quantizes to zeros with any amax)."""
    amax = abs_max(x, start_dim=1).reshape(-1, *([1] * (x.dim() - 1)))
    return torch.where(amax > 0, amax, 1.0).expand(*x.shape[:-1], 1)


DEQ_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dequantize(t: FP4Tensor, dtype: torch.dtype = torch.float32, *, kernel: str | Kernel = "auto") -> torch.Tensor:
    """``t.dequantize(dtype)`` (the Triton kernels write bf16 / fp16 / fp32)."""
    other = None if dtype in DEQ_DTYPES else f"dequantize writes {DEQ_DTYPES}, not {dtype}"
    if select_kernel(kernel, t.codes.device, unsupported=other) is Kernel.REFERENCE:
        return t.dequantize(dtype)
    from . import dequant_triton as dequant

    return dequant.dequantize(t, dtype)


def compact_guidance(record: FP4Tensor | FullGuidance, *, kernel: str | Kernel = "auto") -> CompactGuidance:
    """The compact record (packed mantissa bits + scales) of a quantized tensor or a full record."""
    if not isinstance(record, FP4Tensor | FullGuidance):
        raise TypeError(f"record must be an FP4Tensor or FullGuidance, got {type(record).__name__}")
    if select_kernel(kernel, record.codes.device) is Kernel.REFERENCE:
        bits = e2m1.pack_bits(e2m1.mantissa_bit(e2m1.unpack(record.codes)))
        return CompactGuidance(mantissa_bits=bits, block_scales=record.block_scales,
                               global_amax=record.global_amax, shape=record.shape, fmt=record.fmt)
    from . import dequant_triton as dequant

    return dequant.compact(record)
