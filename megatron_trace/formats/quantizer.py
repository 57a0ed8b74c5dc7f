"""``Quantizer``: the one object that carries a quantization policy, and the STE fake-quant.

Modules never branch on the format: they hold a ``Quantizer`` and call ``quantize``,
``guided_quantize`` or ``fake_quantize``. A ``Quantizer`` is immutable and cheap to build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import block
from .mxfp4 import SCALE_RULES
from .registry import FORMATS, get_format
from .rounding import ROUNDINGS
from .tensor import CompactGuidance, FP4Tensor, FullGuidance


@dataclass(frozen=True)
class Quantizer:
    """A quantization policy.

    fmt: "nvfp4" | "mxfp4". per_row: NVFP4 global amax per row (activations) instead of per
    tensor (weights). scale_rule: MXFP4 exponent rule. rounding: the own rounding ("rne",
    "stochastic"). ste_clip: zero the straight-through gradient where |x / s| > 6.
    """

    fmt: str = "nvfp4"
    per_row: bool = False
    scale_rule: str = "floor"
    rounding: str = "rne"
    ste_clip: bool = False

    def __post_init__(self):
        for name in ("per_row", "ste_clip"):  # (ste_clip="no" is truthy: it clipped the gradient)
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.fmt not in FORMATS:  # record-only formats (registry.RECORD_FORMATS) are not quantized with
            raise ValueError(f"fmt={self.fmt!r} is not one of {FORMATS}")
        if self.scale_rule not in SCALE_RULES:  # (MXFP4's; checked for every format: a typo must not pass silently)
            raise ValueError(f"scale_rule={self.scale_rule!r} is not one of {SCALE_RULES}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r} is not one of {ROUNDINGS}")
        if self.per_row and self.fmt != "nvfp4":
            raise ValueError(f"per_row applies to nvfp4 only, got fmt={self.fmt!r}")

    @property
    def format(self):
        return get_format(self.fmt, self.scale_rule)

    @property
    def block_size(self) -> int:
        return self.format.block_size

    def quantize(self, x: torch.Tensor, *, global_amax=None, generator=None) -> FP4Tensor:
        return self._quantize(x, global_amax=global_amax, generator=generator)[0]

    def quantize_with_clip_mask(self, x: torch.Tensor, *, guidance=None, global_amax=None
                                ) -> tuple[FP4Tensor, torch.Tensor]:
        """``quantize`` (``guided_quantize`` with ``guidance``) and the bool mask (x's shape) of the elements
        inside the clip range, |x / s| <= 6: where ``ste_clip``'s straight-through gradient passes."""
        q, z = self._quantize(x, global_amax=global_amax, guidance=guidance)
        return q, clip_mask(z, x.shape[-1])

    def guided_quantize(self, x: torch.Tensor, guidance: FullGuidance | CompactGuidance) -> FP4Tensor:
        return block.guided_quantize_with_z(self.format, x, guidance)[0]

    def _quantize(self, x, *, global_amax=None, generator=None, guidance=None):
        if guidance is not None:
            return block.guided_quantize_with_z(self.format, x, guidance)
        if global_amax is not None and self.fmt != "nvfp4":
            raise ValueError(f"{self.fmt.upper()} has no global amax: pass global_amax=None")
        kw = {"global_amax": global_amax, "per_row": self.per_row} if self.fmt == "nvfp4" else {}
        return block.quantize_with_z(self.format, x, rounding=self.rounding, generator=generator, **kw)

    def fake_quantize(self, x: torch.Tensor, *, guidance=None, global_amax=None, generator=None) -> torch.Tensor:
        """Quantize-dequantize ``x`` (guided if ``guidance`` is given) with a straight-through gradient."""
        return _FakeQuant.apply(x, self, guidance, global_amax, generator)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, quantizer: Quantizer, guidance, global_amax, generator):
        q, z = quantizer._quantize(x.detach(), global_amax=global_amax, generator=generator, guidance=guidance)
        if quantizer.ste_clip:
            ctx.save_for_backward(clip_mask(z, x.shape[-1]))
        ctx.ste_clip = quantizer.ste_clip
        return q.dequantize(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ste_backward(ctx, grad)


def clip_mask(z: torch.Tensor, k: int) -> torch.Tensor:
    """Elements of the scaled blocks ``z`` [..., blocks, block] inside the clip range, as [..., k] (K padding cut)."""
    return (z.abs() <= 6.0).flatten(-2)[..., :k]


def ste_backward(ctx, grad):
    """The straight-through gradient of a fake-quant function ``f(x, *4 non-tensor args)``: identity, or
    masked outside the clip range when ``ctx.ste_clip`` (the bool mask is the saved tensor)."""
    if ctx.ste_clip:
        (inside,) = ctx.saved_tensors
        grad = grad * inside.to(grad.dtype)
    return grad, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    *,
    guidance: FullGuidance | CompactGuidance | None = None,
    global_amax=None,
    per_row: bool = False,
    scale_rule: str = "floor",
    rounding: str = "rne",
    generator: torch.Generator | None = None,
    ste_clip: bool = False,
) -> torch.Tensor:
    """Quantize-dequantize with a straight-through gradient (identity, or masked outside ±6·s)."""
    qz = Quantizer(fmt=fmt, per_row=per_row, scale_rule=scale_rule, rounding=rounding, ste_clip=ste_clip)
    return qz.fake_quantize(x, guidance=guidance, global_amax=global_amax, generator=generator)


def check_finite_or_raise(x: torch.Tensor, what: str = "x") -> None:
    """Public NaN/Inf check with the same message as the quantizers."""
    block.check_input(x, what=what)
