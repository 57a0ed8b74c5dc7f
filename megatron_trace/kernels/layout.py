"""Layout checks of the FP4 tensors the Triton paths read (host side; imports no Triton).

A kernel reads an ``FP4Tensor``'s codes, block scales and global amax through raw pointers with the sizes that
``shape`` implies: parts that disagree with it (a short codes tensor, int8 codes, E8M0 scales in an NVFP4 tensor)
would be read out of bounds or decoded as another format, where the reference raises or decodes them otherwise.
``check_fp4`` names the part that does not fit and what would (``formats.tensor``'s module docstring: the layout).
"""

from __future__ import annotations

import torch

from ..formats.registry import get_format
from ..formats.tensor import FP4Tensor, FullGuidance


def check_fp4(t, what: str = "t") -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the part of ``t`` (an FP4Tensor or FullGuidance) that does not
    fit its ``shape`` and ``fmt``: uint8 codes [..., Kp/2], block scales of the format's dtype [..., Kp/B], the
    NVFP4 global amax [] or [..., 1] (None for the other formats), all on the codes' device."""
    if not isinstance(t, FP4Tensor | FullGuidance):
        raise TypeError(f"{what} must be an FP4Tensor or FullGuidance, got {type(t).__name__}")
    fmt = get_format(t.fmt)  # (a ValueError naming the known formats)
    shape = tuple(t.shape)
    if not shape:
        raise ValueError(f"{what}.shape must have at least one dim, got {shape}")
    lead, k = shape[:-1], shape[-1]
    nb = -(-k // fmt.block_size)
    parts = {"codes": (t.codes, torch.uint8, (*lead, nb * fmt.block_size // 2)),
             "block_scales": (t.block_scales, fmt.scale_dtype, (*lead, nb))}
    for name, (v, dtype, want) in parts.items():
        if not isinstance(v, torch.Tensor) or v.dtype != dtype:
            got = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
            raise TypeError(f"{what}.{name} must be {dtype} for fmt={t.fmt!r}, got {got}")
        if tuple(v.shape) != want:
            raise ValueError(f"{what}.{name} has shape {tuple(v.shape)}, expected {want} for shape {shape} "
                             f"(fmt={t.fmt!r}, blocks of {fmt.block_size})")
    g = t.global_amax
    if t.fmt != "nvfp4":
        if g is not None:
            raise ValueError(f"{what}.global_amax must be None for fmt={t.fmt!r}, got a tensor")
    elif not isinstance(g, torch.Tensor) or not g.dtype.is_floating_point:
        got = g.dtype if isinstance(g, torch.Tensor) else type(g).__name__
        raise TypeError(f"{what}.global_amax must be a float tensor for fmt='nvfp4', got {got}")
    elif g.dim() and tuple(g.shape) != (*lead, 1):
        raise ValueError(f"{what}.global_amax has shape {tuple(g.shape)}, expected [] (per tensor) or "
                         f"{(*lead, 1)} (per row)")
    for name, v in (("block_scales", t.block_scales), ("global_amax", g)):
        if v is not None and v.device != t.codes.device:
            raise ValueError(f"{what}.{name} is on {v.device}, its codes on {t.codes.device}: one device")
