"""``cuLaunchKernel`` for the NVRTC-compiled kernels (``moe_mma``, ``moe_wgmma``), with one libcuda handle per process.

The kernels come from ``torch.cuda._compile_kernel``. Its launcher (``_CudaKernel.__call__``, torch 2.8-2.13) opens
libcuda with ``ctypes.CDLL`` on every call, which dlopens and builds a ctypes class each time. That is about 50 us
of host time per launch, several times the launch itself (BENCHMARKS.md, session 31). Here the library and its
``cuLaunchKernel`` are looked up once. Arguments are passed as the kernels declare them: tensors as device
pointers, Python ints as 32-bit ``int``, and ctypes values (a CUtensorMap) by value.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver library, as torch's launcher opens it (Linux)."""
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _launch_fn():
    fn = driver().cuLaunchKernel
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                   ctypes.c_void_p]
    return fn


def current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (what a launch queues on; a capture's stream too)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def launch(func, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, stream: int,
           args: list) -> None:
    """Launch the kernel ``func`` (a ``_compile_kernel`` result's ``.func``) on the raw ``stream`` handle. ``args``:
    tensors (passed as device pointers), ints (32-bit) and ctypes values (passed by value), in the kernel's order.
    Raises ``RuntimeError`` with the driver's message where the launch fails."""
    keep = [a if isinstance(a, ctypes._SimpleCData | ctypes.Array | ctypes.Structure)
            else ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(keep))(*[ctypes.addressof(v) for v in keep])
    res = _launch_fn()(func, *grid, *block, shared_mem, stream, params, None)
    if res:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(res, ctypes.byref(msg))
        raise RuntimeError(f"cuLaunchKernel failed with CUresult {res} "
                           f"({(msg.value or b'unknown error').decode()}): grid {grid}, block {block}, "
                           f"{shared_mem} bytes of shared memory")
