"""``cuLaunchKernel`` for the NVRTC-compiled kernels (``moe_mma``, ``moe_wgmma``), with one libcuda handle per process.

The kernels come from ``torch.cuda._compile_kernel``. Its launcher (``_CudaKernel.__call__``, torch 2.8-2.13) opens
libcuda with ``ctypes.CDLL`` on every call, which dlopens and builds a ctypes class each time. That is about 50 us
of host time per launch, several times the launch itself (BENCHMARKS.md, session 31). Here the library and its
``cuLaunchKernel`` are looked up once. Arguments are passed as the kernels declare them (``params``): tensors as
device pointers, Python ints as 32-bit ``int``, and ctypes values (a CUtensorMap) by value.
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
    """Launch the kernel ``func`` (a ``_compile_kernel`` result's ``.func``) on the raw ``stream`` handle with
    ``params(args)``. Raises ``RuntimeError`` with the driver's message where the launch fails."""
    keep = params(args)
    res = _launch_fn()(func, *grid, *block, shared_mem, stream,
                       (ctypes.c_void_p * len(keep))(*[ctypes.addressof(v) for v in keep]), None)
    if res:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(res, ctypes.byref(msg))
        raise RuntimeError(f"cuLaunchKernel failed with CUresult {res} "
                           f"({(msg.value or b'unknown error').decode()}): grid {grid}, block {block}, "
                           f"{shared_mem} bytes of shared memory")


_BY_VALUE = (ctypes._SimpleCData, ctypes.Array, ctypes.Structure)


def params(args: list) -> list:
    """The kernel parameters of ``args``, in order: CUDA tensors as device pointers, ints (bools too) as 32-bit
    ``int``, ctypes values as they are (passed by value). Raises ``ValueError`` / ``TypeError`` naming an argument
    that is none of these or does not fit (an int outside int32 would wrap silently)."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, _BY_VALUE):
            out.append(a)
        elif isinstance(a, torch.Tensor):
            if not a.is_cuda:
                raise ValueError(f"kernel argument {i} is a tensor on {a.device}; the kernels read CUDA memory")
            out.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, int):
            if not -(2**31) <= a < 2**31:
                raise ValueError(f"kernel argument {i} = {a} does not fit the kernel's 32-bit int")
            out.append(ctypes.c_int(a))
        else:
            raise TypeError(f"kernel argument {i} is a {type(a).__name__}: expected a CUDA tensor, an int or a "
                            "ctypes value")
    return out
