"""E2M1 (FP4) codewords: encode, decode, pack, mantissa bits, brackets.

A code is a 4-bit nibble ``s e1 e0 m``: bit 3 is the sign, bits 0..2 index
``E2M1_GRID`` = {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Code 8 is -0. There is no Inf/NaN;
values beyond ±6 saturate. The mantissa bit is the code's LSB; any two adjacent
grid points (also -0.5 | 0 | 0.5) differ in it, which is what compact guidance uses.

Codes are held one per uint8 ("unpacked") or two per byte ("packed": element 2i in
the low nibble, 2i+1 in the high nibble), matching ``torch.float4_e2m1fn_x2``.
"""

from __future__ import annotations

import torch

from .constants import E2M1_GRID, E2M1_MAX

# Round-to-nearest-even thresholds on |x|: (threshold, tie goes up?). A tie goes to
# the neighbour with an even mantissa (code LSB 0).
_RNE_THRESHOLDS = (
    (0.25, False),  # 0 | 0.5   -> tie to 0
    (0.75, True),  # 0.5 | 1   -> tie to 1
    (1.25, False),  # 1 | 1.5   -> tie to 1
    (1.75, True),  # 1.5 | 2   -> tie to 2
    (2.5, False),  # 2 | 3     -> tie to 2
    (3.5, True),  # 3 | 4     -> tie to 4
    (5.0, False),  # 4 | 6     -> tie to 4
)

SIGNED_GRID = tuple(sorted({-v for v in E2M1_GRID} | set(E2M1_GRID)))
"""The 15 distinct signed E2M1 values, ascending (-6 .. 6)."""


def _grid(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)


def _signed_grid(device: torch.device) -> torch.Tensor:
    return torch.tensor(SIGNED_GRID, dtype=torch.float32, device=device)


def check_codes(codes: torch.Tensor) -> None:
    """Raise if ``codes`` (unpacked nibbles or packed bytes) is not uint8. The values are not read (a host sync
    per call on a GPU): the functions here mask an unpacked code to its low 4 bits."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"E2M1 codes must be torch.uint8, got {codes.dtype}")


def encode_rne(x: torch.Tensor) -> torch.Tensor:
    """Round float values to E2M1 codes (RNE, saturating at ±6). Returns uint8 [same shape].

    The sign bit follows ``signbit(x)``: a small negative value gives -0 (code 8).
    NaN is not representable: callers check finiteness first.
    """
    a = x.float().abs()
    idx = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t, tie_up in _RNE_THRESHOLDS:
        idx += (a >= t) if tie_up else (a > t)
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (unpacked uint8) -> values. -0 decodes to -0.0."""
    check_codes(codes)
    mag = _grid(codes.device)[(codes & 7).long()]
    neg = (codes & 8).bool()
    return torch.where(neg, -mag, mag).to(dtype)


def encode_value(values: torch.Tensor, sign_like: torch.Tensor | None = None) -> torch.Tensor:
    """Exact grid values (signed) -> codes. Zeros take their sign from ``sign_like`` if given."""
    a = values.float().abs()
    idx = torch.searchsorted(_grid(values.device), a.contiguous()).to(torch.uint8)
    sign_src = values if sign_like is None else torch.where(values == 0, sign_like.float(), values)
    return idx | (torch.signbit(sign_src).to(torch.uint8) << 3)


def mantissa_bit(codes: torch.Tensor) -> torch.Tensor:
    """The mantissa bit (LSB) of each code, uint8 0/1."""
    check_codes(codes)
    return codes & 1


def bracket(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Adjacent signed grid points ``(lo, hi)`` with ``lo <= clip(z) <= hi`` (equal on the grid).

    ``z`` is clipped to [-6, 6] first. Returns float32 tensors of z's shape.
    """
    g = _signed_grid(z.device)
    zc = z.float().clamp(-E2M1_MAX, E2M1_MAX)
    hi_i = torch.searchsorted(g, zc.contiguous(), right=False)  # first g >= z
    hi = g[hi_i.clamp(max=len(SIGNED_GRID) - 1)]
    lo_i = torch.where(hi == zc, hi_i, hi_i - 1).clamp(min=0)
    return g[lo_i], hi


def value_mantissa_bit(values: torch.Tensor) -> torch.Tensor:
    """Mantissa bit of exact signed grid values (0 for ±0), uint8."""
    idx = torch.searchsorted(_grid(values.device), values.float().abs().contiguous())
    return (idx & 1).to(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked codes [..., K] (K even) -> packed bytes [..., K/2]; element 2i in the low nibble."""
    check_codes(codes)
    if codes.dim() == 0 or codes.shape[-1] % 2:  # (0-d: a bare IndexError)
        raise ValueError(f"pack needs an even last dim, got shape {tuple(codes.shape)}")
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., K/2] -> unpacked codes [..., K]."""
    check_codes(packed)
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """0/1 uint8 [..., K] (K % 8 == 0) -> bytes [..., K/8]; element 8i+j is bit j of byte i."""
    if bits.dtype not in (torch.uint8, torch.bool):  # (float 0.7 packed as 0; values are not read: a host sync)
        raise TypeError(f"pack_bits needs 0/1 torch.uint8 (or bool) bits, got {bits.dtype}")
    if bits.dim() == 0 or bits.shape[-1] % 8:
        raise ValueError(f"pack_bits needs a last dim divisible by 8, got shape {tuple(bits.shape)}")
    b = bits.to(torch.uint8).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)  # made on the device: no host copy, no sync
    return (b << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., K/8] -> 0/1 uint8 [..., K]."""
    check_codes(packed)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], 8 * packed.shape[-1])


def to_float4_x2(packed: torch.Tensor) -> torch.Tensor:
    """View packed codes as ``torch.float4_e2m1fn_x2`` (same bytes). Needs torch >= 2.8."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        raise RuntimeError(f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype (needs >= 2.8)")
    check_codes(packed)
    return packed.view(torch.float4_e2m1fn_x2)


def from_float4_x2(t: torch.Tensor) -> torch.Tensor:
    """View a ``torch.float4_e2m1fn_x2`` tensor as packed uint8 codes."""
    if t.dtype == torch.uint8:
        return t
    return t.view(torch.uint8)
