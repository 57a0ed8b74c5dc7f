"""Rounding of already-scaled values ``z`` onto the E2M1 grid (DESIGN.md §2).

All functions take ``z`` (the element divided by its effective block scale) and return
unpacked E2M1 codes (uint8, one per element). The block-scaling formats in
``nvfp4``/``mxfp4`` compute ``z``; this module only decides the codeword.

* ``rne``: round-to-nearest-even, saturating at ±6.
* ``stochastic``: unbiased stochastic rounding between the two bracketing grid points.
* ``guided_full``: of the bracket ``{lo, hi}`` of ``clip(z)``, the point closest to the
  rollout's codeword.
* ``guided_compact``: of the bracket, the point whose mantissa bit equals the recorded bit.

Zero results carry the sign of ``z`` (like RNE), except that guided-full rounding emits the
rollout's own code whenever it picks the rollout's value, so -0 is reproduced too.
Codeword comparisons elsewhere in the project compare decoded values (±0 are equal).
"""

from __future__ import annotations

import torch

from . import e2m1

ROUNDINGS = ("rne", "stochastic")
"""The trainer's own rounding modes (guided rounding needs a record, see ``guided_*``)."""


def rne(z: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto E2M1 (saturating)."""
    return e2m1.encode_rne(z)


def stochastic(z: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unbiased stochastic rounding: ``P(hi) = (z - lo) / (hi - lo)`` inside the bracket.

    Deterministic for a seeded ``generator``; values beyond ±6 saturate.
    """
    lo, hi = e2m1.bracket(z)
    zc = z.float().clamp(-6.0, 6.0)
    width = hi - lo
    p_hi = torch.where(width > 0, (zc - lo) / torch.where(width > 0, width, 1.0), 0.0)
    u = torch.rand(z.shape, generator=generator, device=z.device, dtype=torch.float32)
    q = torch.where(u < p_hi, hi, lo)
    return e2m1.encode_value(q, sign_like=z)


def guided_full(z: torch.Tensor, rollout_codes: torch.Tensor) -> torch.Tensor:
    """Pick the bracket point nearest to the rollout's codeword (unpacked codes, z's shape).

    Guarantees ``|q - q_roll| <= |q_rne - q_roll|`` elementwise and ``q == q_roll`` whenever
    ``q_roll`` is a bracket point of ``z``.
    """
    if rollout_codes.shape != z.shape:
        raise ValueError(f"rollout codes shape {tuple(rollout_codes.shape)} != values shape {tuple(z.shape)}")
    lo, hi = e2m1.bracket(z)
    q_roll = e2m1.decode(rollout_codes)
    d_lo, d_hi = (lo - q_roll).abs(), (hi - q_roll).abs()
    # A tie needs q_roll halfway between adjacent grid points, which is never a grid point.
    q = torch.where(d_lo <= d_hi, lo, hi)
    own = e2m1.encode_value(q, sign_like=z)
    return torch.where(q == q_roll, rollout_codes, own)


def guided_compact(z: torch.Tensor, mantissa_bits: torch.Tensor) -> torch.Tensor:
    """Pick the bracket point whose mantissa bit equals the recorded bit (0/1 uint8, z's shape)."""
    if mantissa_bits.shape != z.shape:
        raise ValueError(f"mantissa bits shape {tuple(mantissa_bits.shape)} != values shape {tuple(z.shape)}")
    lo, hi = e2m1.bracket(z)
    q = torch.where(e2m1.value_mantissa_bit(lo) == mantissa_bits, lo, hi)
    return e2m1.encode_value(q, sign_like=z)


def round_codes(z: torch.Tensor, rounding: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Dispatch the trainer's own rounding by name (``"rne"`` or ``"stochastic"``)."""
    if rounding == "rne":
        return rne(z)
    if rounding == "stochastic":
        return stochastic(z, generator)
    raise ValueError(f"rounding={rounding!r} is not one of {ROUNDINGS}")
