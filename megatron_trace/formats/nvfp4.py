"""NVFP4: E2M1 elements in 1x16 blocks along K, E4M3 block scales, FP32 global amax (DESIGN.md §3).

  S_enc = min(448 * 6 / amax_global, FLT_MAX) (1.0 where amax_global == 0)
  sf    = e4m3_rn_sat(S_enc * amax_block / 6)  (saturates at 448)
  q     = rne_e2m1(x * S_enc / fp32(sf))       (0 where sf == 0: all-zero or underflowing block)
  x_hat = q * fp32(sf) / S_enc

``global_amax`` granularity: per tensor (weights; the default), per row (``per_row=True``:
one amax per token row, batch-invariant) or given (static/calibrated: a float or a float32
tensor of shape [] or [..., 1]). ModelOpt checkpoints store the reciprocal encode scale
``amax / (6 * 448)`` as ``weight_scale_2`` / ``input_scale``: see ``decode_scale_from_amax``.

S_enc saturates at the largest float32 (as Transformer Engine's ``compute_global_encode_scaling_factor_FP4``
does) where 2688 / amax overflows, i.e. for 0 < amax < 2688 / FLT_MAX ~= 7.9e-36: without the clamp S_enc is
inf, every code saturates, an all-zero block's scale is NaN and the dequantized values are 0 or NaN.
"""

from __future__ import annotations

import numbers

import torch

from . import block
from .constants import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK
from .tensor import FP4Tensor, GuidanceMismatchError

NVFP4Tensor = FP4Tensor
"""An FP4Tensor with ``fmt == "nvfp4"``: codes, block_scales (float8_e4m3fn), global_amax."""

_ENC_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688
_FLT_MAX = torch.finfo(torch.float32).max


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    """IEEE fp32 ``a / b`` for a constant ``b``. (``tensor / python_float`` may become a reciprocal multiply
    on CUDA and ``python_float / tensor`` is ``reciprocal(t) * float`` in torch: two roundings.)"""
    return a / torch.full_like(a, b)


def encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax (one IEEE fp32 division) saturated at FLT_MAX, 1.0 where amax == 0."""
    g = global_amax.float()
    safe = torch.where(g > 0, g, 1.0)
    return torch.where(g > 0, (torch.full_like(safe, _ENC_NUMERATOR) / safe).clamp(max=_FLT_MAX), 1.0)


def decode_scale_from_amax(global_amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2`` / ``input_scale`` convention: amax / (6 * 448); fp32(1 / FLT_MAX) = 2**-128
    where ``encode_scale`` saturates, so that codes * block scale * this decodes what was encoded with S_enc =
    FLT_MAX (within an ulp, as amax / 2688 does an unsaturated S_enc's)."""
    g = global_amax.float()
    return torch.where(encode_scale(g) == _FLT_MAX, torch.full_like(g, 1.0 / _FLT_MAX), _div(g, _ENC_NUMERATOR))


class NVFP4Format:
    """Scale policy of NVFP4 (used by the generic block quantizer)."""

    name = "nvfp4"
    block_size = NVFP4_BLOCK
    scale_dtype = torch.float8_e4m3fn

    def global_amax(self, x: torch.Tensor, *, global_amax=None, per_row: bool = False,
                    check_values: bool = True) -> torch.Tensor:
        """The amax the encode scale uses: ``global_amax`` checked (shape; values finite and > 0 unless
        ``check_values=False``, for a caller that checks them on the device), or x's per tensor / per row."""
        if not isinstance(per_row, bool):  # ("no" is truthy: one amax per row)
            raise ValueError(f"per_row={per_row!r} must be a bool")
        if global_amax is not None:
            if isinstance(global_amax, bool) or not isinstance(global_amax, numbers.Real | torch.Tensor):
                raise TypeError(f"global_amax={global_amax!r} must be a number or a float32 tensor ([] or "
                                f"{(*x.shape[:-1], 1)}), got {type(global_amax).__name__}")
            if per_row:
                raise ValueError("give either global_amax (static) or per_row=True, not both")
            g = torch.as_tensor(global_amax, dtype=torch.float32, device=x.device)
            self.check_global_amax(g, x)
            if check_values and (not bool(torch.isfinite(g).all()) or bool((g <= 0).any())):
                raise ValueError(f"a given global_amax must be finite and > 0, got {g.flatten()[:4].tolist()}")
            return g
        a = x.detach().float().abs()
        if per_row:
            return a.amax(-1, keepdim=True)
        return a.amax() if a.numel() else a.new_zeros(())  # no element (e.g. an EP rank without tokens): 0

    def check_global_amax(self, g, x: torch.Tensor) -> None:
        if g is None or not isinstance(g, torch.Tensor):
            raise GuidanceMismatchError(f"NVFP4 needs a float32 global_amax tensor, got {type(g).__name__}")
        if g.dim() and tuple(g.shape) != (*x.shape[:-1], 1):
            raise GuidanceMismatchError(
                f"global_amax shape {tuple(g.shape)} must be [] (per tensor) or {(*x.shape[:-1], 1)} (per row)"
            )

    def block_scales(self, xb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        s_enc = encode_scale(g)  # [] or [..., 1]
        v = _div(s_enc * xb.abs().amax(-1), E2M1_MAX)
        return v.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)

    def scale_values(self, xb: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        sf = scales.float().unsqueeze(-1)  # [..., nb, 1]
        s_enc = encode_scale(g)
        s_enc = s_enc.unsqueeze(-1) if s_enc.dim() else s_enc
        ok = sf > 0
        return torch.where(ok, xb * s_enc / torch.where(ok, sf, 1.0), 0.0)

    def unscale(self, q: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        s_enc = encode_scale(g)
        s_enc = s_enc.unsqueeze(-1) if s_enc.dim() else s_enc
        return q * scales.float().unsqueeze(-1) / s_enc


FORMAT = NVFP4Format()


def quantize(
    x: torch.Tensor,
    *,
    global_amax: float | torch.Tensor | None = None,
    per_row: bool = False,
    rounding: str = "rne",
    generator: torch.Generator | None = None,
) -> FP4Tensor:
    """Quantize ``x`` [..., K] to NVFP4 (K padded to a multiple of 16 internally)."""
    return block.quantize_with_z(
        FORMAT, x, global_amax=global_amax, per_row=per_row, rounding=rounding, generator=generator
    )[0]


def guided_quantize(x: torch.Tensor, guidance) -> FP4Tensor:
    """Guided rounding toward a rollout record (FullGuidance or CompactGuidance), using its scales."""
    return block.guided_quantize_with_z(FORMAT, x, guidance)[0]
