"""``kernels.cuda_launch`` on the GPU (skipped elsewhere): the NVRTC GEMMs it launches queue on the current stream
(a side stream, a CUDA-graph capture) with the bits of a default-stream launch, and a launch the driver refuses
raises with the driver's message."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.kernels import cuda_launch, moe_mma, moe_wgmma

from ._common import grouped_gemm_case

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs an sm_90+ GPU (the NVRTC kernels)", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _gemms():
    """(name, a no-argument call of each CUDA GEMM on fresh operands)."""
    x, wq, offs = grouped_gemm_case("nvfp4", True, 6, 256, 1024, [1, 4, 0, 9, 16, 2], 0, 3, 0.02)
    packed = moe_mma.pack(wq)
    xw, wqw, offsw = grouped_gemm_case("nvfp4", False, 3, 256, 1024, [200, 0, 77], 1, 3, 0.02)
    pw = moe_wgmma.pack(wqw)
    return {"mma": lambda: moe_mma.grouped_mm(x, packed, offs),
            "wgmma": lambda: moe_wgmma.grouped_mm(xw, pw, offsw)}


@pytest.mark.parametrize("name", ["mma", "wgmma"])
def test_side_stream_and_graph_replay_give_the_default_stream_bits(name):
    fn = _gemms()[name]
    want = fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # (a launch on the default stream instead would read y before it exists)
        got = fn()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)
    with torch.cuda.stream(side):
        fn()  # (warm-up off the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_a_refused_launch_names_the_driver_error():
    kern = moe_mma._kernel(torch.cuda.current_device(), False, True, True, 4, moe_mma.DEFINES)
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel failed with CUresult \d+ \(.+\): grid \(1, 1, 1\)"):
        cuda_launch.launch(kern.func, (1, 1, 1), (moe_mma.THREADS, 1, 1), 1 << 20,
                           cuda_launch.current_stream(torch.device("cuda")), [])
    x, wq, offs = grouped_gemm_case("nvfp4", False, 2, 256, 1024, [3, 1], 0, 0, 0.02)
    assert moe_mma.grouped_mm(x, wq, offs).isfinite().all()  # (the context is usable after the refusal)
