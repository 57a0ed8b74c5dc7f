"""Storage classes: a block-scaled FP4 tensor and the two guidance records derived from it.

Shapes (``K`` = last dim of the original tensor, ``Kp`` = K padded up to the block size ``B``):
  codes          uint8 [..., Kp/2]   packed E2M1, element 2i in the low nibble
  mantissa_bits  uint8 [..., Kp/8]   packed, element 8i+j in bit j (compact guidance)
  block_scales   [..., Kp/B]         float8_e4m3fn (NVFP4) or float8_e8m0fnu (MXFP4)
  global_amax    float32, [] (per tensor) or [..., 1] (per row); None for MXFP4
Padding elements are zero and get zero codes; ``shape`` keeps the unpadded shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import e2m1


def check_float_dtype(dtype, what: str = "dtype") -> torch.dtype:
    """``dtype`` when it is a floating-point ``torch.dtype``; else a TypeError naming it (an int or bool dtype
    truncated the values silently, a string such as "bf16" failed deep in ``Tensor.to``)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{what}={dtype!r} must be a floating-point torch.dtype (e.g. torch.float32)")
    return dtype


def scales_usable(block_scales: torch.Tensor, global_amax: torch.Tensor | None) -> torch.Tensor:
    """bool [..., rows] (``block_scales``' leading dims): the row's block scales ([..., blocks], E4M3 or E8M0) and
    NVFP4 global amax ([] or [..., 1]; None for MXFP4) are of a kind some quantizer writes. No host sync, few ops.

    Finite and >= 0 (-0 passes; E4M3 has no Inf, NaN is 0x7F / 0xFF; E8M0 has no sign, 0xFF is NaN), no E8M0 scale of
    2**127 (byte 254: the largest exponent any rule gives is 126, the ceil rule's at float32's top), and an NVFP4 amax
    of 0 only beside all-zero block scales (it is an all-zero row's; it encodes with S_enc = 1, so a nonzero scale
    beside it, e.g. a lost amax, would decode 2688 / amax_true times off). The scales are read as bytes (two byte
    maxima per row, no float conversion): an E4M3 byte above 0x80 is negative and nonzero (or 0xFF), a magnitude
    byte (low 7 bits) of 0x7F is NaN, and one of 0 is +-0."""
    b = block_scales.view(torch.uint8)
    zero = None
    if block_scales.dtype == torch.float8_e4m3fn:
        mag = (b & 0x7F).amax(-1)
        ok = (b.amax(-1) <= 0x80) & (mag != 0x7F)
        zero = mag == 0
    else:  # E8M0: bytes 254 (2**127) and 255 (NaN) are refused
        ok = b.amax(-1) < 254
    if global_amax is not None:
        g = global_amax.float()
        g = (g.squeeze(-1) if g.dim() else g).to(ok.device)
        ok = ok & (g >= 0) & (g < float("inf"))  # NaN fails both
        if zero is not None:  # an amax of (-)0: every block scale +-0
            ok = ok & ((g > 0) | zero)
    return ok


class GuidanceMismatchError(ValueError):
    """A guidance record does not fit the tensor it is applied to (shape, format, dtype)."""


class NonFiniteError(ValueError):
    """A tensor to quantize holds NaN or Inf."""


@dataclass(frozen=True)
class _Blocked:
    block_scales: torch.Tensor
    global_amax: torch.Tensor | None
    shape: tuple[int, ...]
    fmt: str

    @property
    def padded_k(self) -> int:
        return self.block_scales.shape[-1] * self.block_size

    @property
    def block_size(self) -> int:
        from .registry import get_format

        return get_format(self.fmt).block_size


@dataclass(frozen=True)
class FullGuidance(_Blocked):
    """The rollout's full outcome: packed codes + scales (4 bits per element)."""

    codes: torch.Tensor = None  # type: ignore[assignment]

    def unpacked_codes(self) -> torch.Tensor:
        return e2m1.unpack(self.codes)

    def to_compact(self) -> CompactGuidance:
        """The compact record of the same outcome (mantissa bits of the codes, same scales)."""
        bits = e2m1.pack_bits(e2m1.mantissa_bit(self.unpacked_codes()))
        return CompactGuidance(mantissa_bits=bits, block_scales=self.block_scales, global_amax=self.global_amax,
                               shape=self.shape, fmt=self.fmt)


@dataclass(frozen=True)
class CompactGuidance(_Blocked):
    """The rollout's compact outcome: packed mantissa bits + scales (1 bit per element)."""

    mantissa_bits: torch.Tensor = None  # type: ignore[assignment]

    def unpacked_bits(self) -> torch.Tensor:
        return e2m1.unpack_bits(self.mantissa_bits)


@dataclass(frozen=True)
class FP4Tensor(_Blocked):
    """A block-scaled FP4 tensor (NVFP4 or MXFP4). See the module docstring for shapes."""

    codes: torch.Tensor = None  # type: ignore[assignment]

    def unpacked_codes(self) -> torch.Tensor:
        """Codes one per uint8, [..., Kp]."""
        return e2m1.unpack(self.codes)

    def values(self) -> torch.Tensor:
        """E2M1 grid values (before scaling), float32 [..., K] (padding trimmed)."""
        return e2m1.decode(self.unpacked_codes())[..., : self.shape[-1]]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded values in ``dtype``, original shape. Computed in fp32 then cast once."""
        check_float_dtype(dtype)  # (int32 truncated 1.5 to 1)
        fmt = self.check_layout()
        q = e2m1.decode(self.unpacked_codes()).unflatten(-1, (-1, fmt.block_size))
        out = fmt.unscale(q, self.block_scales, self.global_amax).flatten(-2)
        return out[..., : self.shape[-1]].to(dtype)

    def check_layout(self):
        """Raise ``ValueError`` unless the codes and block scales are of the format's dtypes and hold ``shape`` (the
        module docstring's layout); returns the format object. (A uint8 view of the scales would decode as integers,
        1.0 in E4M3 as 56.0; a shape of K=200 over 64 coded elements, or of other rows, decoded as the coded ones.)"""
        from .registry import get_format

        fmt = get_format(self.fmt)
        if self.codes.dtype != torch.uint8 or self.block_scales.dtype != fmt.scale_dtype:
            raise ValueError(f"FP4Tensor codes {self.codes.dtype} and block scales {self.block_scales.dtype}: "
                             f"fmt={self.fmt!r} needs torch.uint8 and {fmt.scale_dtype}")
        block = fmt.block_size
        shape = tuple(self.shape)
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"FP4Tensor.shape={shape} must be ints >= 0, at least one")
        nb = -(-shape[-1] // block)
        want = {"codes": (*shape[:-1], nb * block // 2), "block_scales": (*shape[:-1], nb)}
        got = {"codes": tuple(self.codes.shape), "block_scales": tuple(self.block_scales.shape)}
        if got != want:
            raise ValueError(f"FP4Tensor of shape {shape} (fmt={self.fmt!r}, blocks of {block}) needs codes "
                             f"{want['codes']} and block scales {want['block_scales']}, got {got['codes']} and "
                             f"{got['block_scales']}")
        return fmt

    def guidance(self, compact: bool) -> FullGuidance | CompactGuidance:
        """The record a rollout keeps: mantissa bits (compact) or codes (full), plus scales."""
        common = dict(block_scales=self.block_scales, global_amax=self.global_amax, shape=self.shape, fmt=self.fmt)
        if compact:
            return CompactGuidance(mantissa_bits=e2m1.pack_bits(e2m1.mantissa_bit(self.unpacked_codes())), **common)
        return FullGuidance(codes=self.codes, **common)
