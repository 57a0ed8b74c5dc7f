"""Kernel selection: the pure-PyTorch reference (``formats``) or its Triton twin.

``kernel="auto"`` picks Triton for CUDA tensors when Triton imports and the operation has a
Triton path, the reference otherwise; ``"triton"`` insists (and says why it cannot);
``"reference"`` always runs ``formats``. ``TraceConfig.kernel`` holds the same names.
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
    AUTO falls back to the reference for a non-CUDA device, a missing Triton or an unsupported call;
    TRITON raises ``ValueError`` / ``RuntimeError`` naming the reason instead.
    """
    k = parse_kernel(kernel)
    if k is Kernel.REFERENCE:
        return k
    dev = torch.device(device)
    reason = None
    if dev.type != "cuda":
        reason = f"tensors are on {dev}, the Triton kernels need CUDA"
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
