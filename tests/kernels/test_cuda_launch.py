"""``kernels.cuda_launch.params`` on the CPU: what the NVRTC kernels' launches pass, and the arguments it refuses
with their index named (a launch itself: ``tests/gpu/test_cuda_launch_gpu.py``)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from megatron_trace.kernels import cuda_launch


def test_ints_and_ctypes_values_pass_as_the_kernel_declares_them():
    tmap = (ctypes.c_uint64 * 16)(*range(16))
    got = cuda_launch.params([tmap, 7, -(2**31), 2**31 - 1, True])
    assert got[0] is tmap  # by value: the array itself
    assert [type(v) for v in got[1:]] == [ctypes.c_int] * 4
    assert [v.value for v in got[1:]] == [7, -(2**31), 2**31 - 1, 1]


@pytest.mark.parametrize("arg, err, match", [
    (2**31, ValueError, r"argument 1 = 2147483648 does not fit the kernel's 32-bit int"),
    (-(2**31) - 1, ValueError, "argument 1 = -2147483649"),
    (torch.zeros(2), ValueError, "argument 1 is a tensor on cpu"),
    (1.5, TypeError, "argument 1 is a float"),
    (None, TypeError, "argument 1 is a NoneType"),
], ids=["int-too-big", "int-too-small", "cpu-tensor", "float", "none"])
def test_refused_arguments_are_named(arg, err, match):
    with pytest.raises(err, match=match):
        cuda_launch.params([3, arg])
