"""Generic block-scaled FP4 quantization; the format objects (NVFP4, MXFP4) carry the scale policy.

Every path computes ``z = scale_values(x_block)`` with the same operations in the same
order, then picks codes (RNE, stochastic or guided), so the rollout and trainer agree bit for
bit whenever their inputs and scales agree.
"""

from __future__ import annotations

import torch

from . import rounding as rnd
from .tensor import CompactGuidance, FP4Tensor, FullGuidance, GuidanceMismatchError, NonFiniteError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_input(x: torch.Tensor, *, what: str = "x") -> None:
    """Raise a clear error for a non-float dtype, a 0-d tensor or NaN/Inf values."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what}.dtype={x.dtype} is not one of {FLOAT_DTYPES}")
    if x.is_meta:  # (isfinite's bool() below: "Tensor.item() cannot be called on meta tensors")
        raise ValueError(f"{what} is a meta tensor (shape {tuple(x.shape)}, no values): materialize it first")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{what} needs at least one dim with a non-empty last dim, got shape {tuple(x.shape)}")
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = (~finite).nonzero()
        raise NonFiniteError(
            f"{what} holds {bad.shape[0]} NaN/Inf value(s) (first at index {tuple(bad[0].tolist())}); "
            "FP4 has no NaN/Inf: fix the producer or filter the row before quantizing"
        )


def to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 [..., K] -> [..., Kp/block, block], zero-padded along K."""
    k = x.shape[-1]
    pad = (-k) % block
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.unflatten(-1, (-1, block))


def _build(fmt, codes_unpacked, scales, global_amax, shape) -> FP4Tensor:
    from . import e2m1

    return FP4Tensor(
        codes=e2m1.pack(codes_unpacked.flatten(-2)),
        block_scales=scales,
        global_amax=global_amax,
        shape=tuple(shape),
        fmt=fmt.name,
    )


def quantize_with_z(fmt, x, *, global_amax=None, per_row=False, rounding="rne", generator=None):
    """Quantize ``x`` with ``fmt``'s own scales; also return the scaled values ``z`` [..., nb, B]."""
    check_input(x)
    xb = to_blocks(x, fmt.block_size)
    g = fmt.global_amax(x, global_amax=global_amax, per_row=per_row)
    scales = fmt.block_scales(xb, g)
    z = fmt.scale_values(xb, scales, g)
    codes = rnd.round_codes(z, rounding, generator)
    return _build(fmt, codes, scales, g, x.shape), z


def check_guidance(fmt, x: torch.Tensor, guidance) -> None:
    if not isinstance(guidance, FullGuidance | CompactGuidance):
        raise TypeError(f"guidance must be FullGuidance or CompactGuidance, got {type(guidance).__name__}")
    if guidance.fmt != fmt.name:
        raise GuidanceMismatchError(f"guidance format {guidance.fmt!r} != quantizer format {fmt.name!r}")
    if tuple(guidance.shape) != tuple(x.shape):
        raise GuidanceMismatchError(f"guidance is for shape {tuple(guidance.shape)}, tensor has shape {tuple(x.shape)}")
    full = isinstance(guidance, FullGuidance)
    check_layout(fmt, x, guidance.codes if full else guidance.mantissa_bits, 2 if full else 8, guidance)


def check_layout(fmt, x: torch.Tensor, payload: torch.Tensor, per_byte: int, blocked, what: str = "guidance") -> None:
    """Raise ``GuidanceMismatchError`` unless ``blocked``'s (an ``FP4Tensor`` or a guidance record) block scales,
    ``payload`` (``per_byte`` elements a uint8) and global amax have the shapes and dtypes ``fmt`` gives a tensor of
    ``x``'s shape (a smaller one would broadcast when decoded)."""
    nb = -(-x.shape[-1] // fmt.block_size)
    want = (*x.shape[:-1], nb)
    if tuple(blocked.block_scales.shape) != want:
        raise GuidanceMismatchError(f"{what} block_scales shape {tuple(blocked.block_scales.shape)} != {want}")
    if blocked.block_scales.dtype != fmt.scale_dtype:
        raise GuidanceMismatchError(f"{what} block_scales dtype {blocked.block_scales.dtype} != {fmt.scale_dtype}")
    want_payload = (*x.shape[:-1], nb * fmt.block_size // per_byte)
    if payload.dtype != torch.uint8 or tuple(payload.shape) != want_payload:
        raise GuidanceMismatchError(
            f"{what} payload {payload.dtype} {tuple(payload.shape)} != torch.uint8 {want_payload}"
        )
    fmt.check_global_amax(blocked.global_amax, x)


def guided_quantize_with_z(fmt, x, guidance):
    """Guided rounding (DESIGN.md §2) with the rollout's scales; also returns ``z``."""
    check_input(x)
    check_guidance(fmt, x, guidance)
    xb = to_blocks(x, fmt.block_size)
    z = fmt.scale_values(xb, guidance.block_scales, guidance.global_amax)
    if isinstance(guidance, FullGuidance):
        codes = rnd.guided_full(z, guidance.unpacked_codes().unflatten(-1, z.shape[-2:]))
    else:
        codes = rnd.guided_compact(z, guidance.unpacked_bits().unflatten(-1, z.shape[-2:]))
    return _build(fmt, codes, guidance.block_scales, guidance.global_amax, x.shape), z
