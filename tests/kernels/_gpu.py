"""Where the Triton kernels can run in tests, and inputs that stress bit-exactness.

Triton tests run on CUDA; on a machine without CUDA they run on the CPU only when Triton is installed
and ``TRITON_INTERPRET=1`` (Triton's interpreter, slow: small shapes only), else they skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON and not HAS_CUDA

if HAS_CUDA and HAS_TRITON:
    DEVICE = "cuda"
elif INTERPRET:
    DEVICE = "cpu"
else:
    DEVICE = None

REASON = "Triton kernels need CUDA + triton (or triton with TRITON_INTERPRET=1 for the CPU interpreter)"
needs_triton = pytest.mark.skipif(DEVICE is None, reason=REASON)
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor's raw bit pattern on the CPU (so -0.0 != 0.0 and NaN payloads count)."""
    if t is None:
        return None
    t = t.detach().cpu()
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return t.view(torch.uint8)
    return t


def same_bits(a, b) -> bool:
    """Equal bit patterns; NaNs must sit at the same places but their sign/payload is not compared."""
    if a is None or b is None:
        return a is None and b is None
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point and a.dtype.itemsize >= 2:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        a, b = torch.where(nan_a, 0, a), torch.where(nan_b, 0, b)
    return torch.equal(bits(a), bits(b))


def assert_same_fp4(t, r) -> None:
    """Codes, scales, global amax and shape of two FP4Tensors (or records) agree bit for bit."""
    assert t.fmt == r.fmt and tuple(t.shape) == tuple(r.shape)
    for name in ("codes", "mantissa_bits", "block_scales", "global_amax"):
        if hasattr(r, name):
            assert same_bits(getattr(t, name), getattr(r, name)), f"{name} differs"


def rows_view(t, n: int):
    """The first n rows of an FP4 K/V [B, H, T', D] as a view (the rows after them readable, as a cache's
    capacity)."""
    import dataclasses

    g = t.global_amax
    return dataclasses.replace(t, codes=t.codes[:, :, :n], block_scales=t.block_scales[:, :, :n],
                               global_amax=g if g is None or g.dim() == 0 else g[:, :, :n],
                               shape=(*t.shape[:2], n, t.shape[3]))


def random_rows(shape, dtype, gen, spread: float = 4.0) -> torch.Tensor:
    """Normal values whose magnitude varies by 10**[-spread, spread] per 16 elements (many scale regimes)."""
    *lead, k = shape
    nb = -(-k // 16)
    mag = 10.0 ** ((torch.rand(*lead, nb, 1, generator=gen) * 2 - 1) * spread)
    x = (torch.randn(*lead, nb, 16, generator=gen) * mag).flatten(-2)[..., :k]
    return _fit(x, dtype)


def edge_rows(dtype) -> torch.Tensor:
    """[R, 64] rows with RNE ties, zeros of both signs, tiny (subnormal) and huge values.

    The CPU interpreter flushes bf16/fp16 subnormals when converting, so it gets no subnormal half rows.
    """
    big = torch.finfo(dtype).max / 8
    tiny = torch.finfo(dtype).smallest_normal / 4  # subnormal in dtype
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rows = [
        torch.cat([ties, -ties, ties * 2, -ties / 2]),  # mxfp4 scale 1 (block amax 5 or 6): z == x, exact ties
        torch.zeros(64),
        -torch.zeros(64),
        torch.cat([torch.full((16,), 1e-3), torch.zeros(16), torch.full((16,), -1e3), torch.linspace(-7, 7, 16)]),
        torch.full((64,), tiny) * torch.arange(-32, 32),  # subnormal inputs
        torch.linspace(-big, big, 64),  # huge values
        torch.cat([torch.full((16,), big), torch.full((48,), 1e-2)]),  # subnormal / zero e4m3 scales per tensor
        torch.cat([ties * 448 / 6, ties * 2**-9, -ties * 448 / 6, ties * 2**-8]),  # near e4m3 max and min
        torch.arange(-32, 32) * 2.0**-149,  # fp32 subnormals down to the smallest (MXFP4 ceil: amax/6 underflows)
        # MXFP4 ceil: amax / 6 underflows to 0 (log2 -> -inf: e = -127)
        torch.cat([torch.full((1,), 2.0**-149), torch.zeros(31), torch.full((1,), -3 * 2.0**-149), torch.zeros(31)]),
        torch.cat([torch.full((1,), 2e-38), torch.zeros(63)]),  # NVFP4 per row: S_enc saturates at FLT_MAX
    ]
    if INTERPRET and dtype != torch.float32:
        rows = [r for r in rows if not bool(((r != 0) & (r.abs() < torch.finfo(dtype).smallest_normal)).any())]
    return _fit(torch.stack(rows), dtype)


def _fit(x: torch.Tensor, dtype) -> torch.Tensor:
    lim = torch.finfo(dtype).max
    return x.clamp(-lim, lim).to(dtype)
