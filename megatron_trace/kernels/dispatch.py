"""Kernel selection: the pure-PyTorch reference (``formats``) or its Triton twin.

``kernel="auto"`` picks Triton for CUDA tensors on a GPU of compute capability 9.0 or newer when Triton
imports and the operation has a Triton path, the reference otherwise; ``"triton"`` insists (and says why it
cannot); ``"reference"`` always runs ``formats``. ``TraceConfig.kernel`` holds the same names.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)


class Kernel(str, enum.Enum):
    """Which implementation runs a quantization op."""

    AUTO = "auto"
    REFERENCE = "reference"
    TRITON = "triton"


KERNELS = tuple(k.value for k in Kernel)


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def parse_kernel(kernel: str | Kernel) -> Kernel:
    """``"auto" | "reference" | "triton"`` (or a ``Kernel``) -> ``Kernel``; a clear error otherwise."""
    if isinstance(kernel, Kernel):
        return kernel
    try:
        return Kernel(kernel)
    except ValueError:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}") from None


def select_kernel(kernel: str | Kernel, device: torch.device | str, *, unsupported: str | None = None) -> Kernel:
    """Resolve ``kernel`` for tensors on ``device`` to REFERENCE or TRITON.

    ``unsupported``: why the Triton path cannot run this call (e.g. stochastic rounding), or None.
    AUTO falls back to the reference for a non-CUDA device, a GPU older than ``MIN_CAPABILITY``, a missing Triton
    or an unsupported call; TRITON raises ``ValueError`` / ``RuntimeError`` naming the reason instead.
    """
    k = parse_kernel(kernel)
    if k is Kernel.REFERENCE:
        return k
    dev = torch.device(device)
    reason = None
    cap = cuda_capability(dev) if dev.type == "cuda" else None
    if dev.type != "cuda":
        reason = f"tensors are on {dev}, the Triton kernels need CUDA"
    elif cap is not None and cap < MIN_CAPABILITY:
        reason = (f"{dev} has compute capability {cap[0]}.{cap[1]}, the Triton kernels need "
                  f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (they use sm_90 instructions: min.u16x2, "
                  "mul.bf16x2)")
    elif not triton_available():
        reason = "triton is not installed (pip install triton, or use kernel='reference')"
    elif unsupported:
        reason = unsupported
    if reason is None:
        return Kernel.TRITON
    if k is Kernel.TRITON:
        err = RuntimeError if "not installed" in reason else ValueError
        raise err(f"kernel='triton' cannot run: {reason}")
    logger.debug("kernel='auto' uses the reference: %s", reason)
    return Kernel.REFERENCE


MIN_CAPABILITY = (9, 0)
"""The oldest GPU the Triton kernels build for (Hopper): their inline PTX and conversions (``min.u16x2``,
``mul.bf16x2``, E4M3 casts) do not assemble for sm_80 (A100) or sm_89 (L4)."""


def cuda_capability(device) -> tuple[int, int] | None:
    """(major, minor) compute capability of the CUDA ``device`` (an index-less device: the current one), cached;
    None where CUDA is not available (nothing to ask: a launch there fails by itself)."""
    if not torch.cuda.is_available():
        return None
    device = torch.device(device)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def sm_count(device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (an index-less device: the current one), cached."""
    device = torch.device(device)
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` for host code: Triton 3.6 wraps it as a constexpr function, which costs ~5 us per call."""
    return (x + y - 1) // y


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (0 for 0, as Triton's), without its constexpr-function wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
