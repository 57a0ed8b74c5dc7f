"""MXFP4 (OCP MX v1.0): E2M1 elements in 1x32 blocks along K with a power-of-two E8M0 scale.

Scale exponent rules (both supported, by name):
  "floor": e = floor(log2(amax_block)) - 2          (the OCP spec; values up to 8x saturate to 6)
  "ceil":  e = ceil(log2(fp32(amax_block / 6)))     (triton_kernels, ModelOpt, FlashInfer)
e is clamped to [-127, 127]; an all-zero block gets e = -127 (biased 0) and zero codes. At the top of float32's range
the ceil rule's scale 2**126 (block amax >= 7 * 2**125, about 2.98e38) gives codes whose values 4 and 6 dequantize
past float32's largest value, to inf (the codes are kept as the rule gives them); the floor rule stays finite there.
Likewise at the top of a narrower output dtype: in fp16, a block with amax > 49152 has scale 2**14 under the ceil rule,
and its elements >= 57344 round to 4 * 2**14 = 65536, inf in fp16 (bf16: the float32 case). Engines dequantize the
same codes the same way, so this is kept, not clamped (a later NaN/Inf check reports it).
Scales are stored as ``torch.float8_e8m0fnu`` (biased exponent e + 127). There is no global amax.
"""

from __future__ import annotations

import torch

from . import block
from .constants import E2M1_EMAX, E2M1_MAX, E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, MXFP4_BLOCK
from .tensor import FP4Tensor, GuidanceMismatchError

MXFP4Tensor = FP4Tensor
SCALE_RULES = ("floor", "ceil")


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer e in [-127, 127], built from the bit pattern."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    return torch.where(e >= -126, normal, torch.full_like(normal, 2.0**-127))


def scale_exponents(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales -> unbiased int32 exponents."""
    return scales.view(torch.uint8).to(torch.int32) - E8M0_BIAS


class MXFP4Format:
    name = "mxfp4"
    block_size = MXFP4_BLOCK
    scale_dtype = torch.float8_e8m0fnu

    def __init__(self, scale_rule: str = "floor"):
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule={scale_rule!r} is not one of {SCALE_RULES}")
        self.scale_rule = scale_rule

    def global_amax(self, x, *, global_amax=None, per_row=False):
        if global_amax is not None or per_row:
            raise ValueError("MXFP4 has no global amax: leave global_amax=None and per_row=False")
        return None

    def check_global_amax(self, g, x) -> None:
        if g is not None:
            raise GuidanceMismatchError("an MXFP4 record must not carry a global_amax")

    def block_scales(self, xb: torch.Tensor, g) -> torch.Tensor:
        amax = xb.abs().amax(-1)
        if self.scale_rule == "floor":
            _, ex = torch.frexp(amax)  # amax = m * 2**ex, m in [0.5, 1)
            e = ex - 1 - E2M1_EMAX
        else:
            m, ex = torch.frexp(amax / torch.full_like(amax, E2M1_MAX))  # one IEEE division
            e = torch.where(m == 0.5, ex - 1, ex)
            # amax <= 3 * 2**-149: amax / 6 underflows to 0 (frexp: ex = 0), log2 -> -inf: the clamp's -127
            e = torch.where(m == 0, E8M0_MIN_EXP, e)
        e = torch.where(amax > 0, e, E8M0_MIN_EXP).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
        return (e + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)

    def scale_values(self, xb, scales, g):
        return xb * pow2(-scale_exponents(scales)).unsqueeze(-1)

    def unscale(self, q, scales, g):
        return q * pow2(scale_exponents(scales)).unsqueeze(-1)


def quantize(
    x: torch.Tensor,
    *,
    scale_rule: str = "floor",
    rounding: str = "rne",
    generator: torch.Generator | None = None,
) -> FP4Tensor:
    """Quantize ``x`` [..., K] to MXFP4 (K padded to a multiple of 32 internally)."""
    return block.quantize_with_z(MXFP4Format(scale_rule), x, rounding=rounding, generator=generator)[0]


def guided_quantize(x: torch.Tensor, guidance) -> FP4Tensor:
    """Guided rounding toward an MXFP4 rollout record, using its scales."""
    return block.guided_quantize_with_z(MXFP4Format(), x, guidance)[0]
