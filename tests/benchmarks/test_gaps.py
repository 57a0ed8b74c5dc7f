"""``benchmarks/_gaps.idle_gaps`` on a hand-built Chrome trace: idle time, gaps and the host ops behind them."""

from __future__ import annotations

from benchmarks._gaps import idle_gaps


def _x(name, cat, ts, dur, corr=None):
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_gaps_are_attributed_to_the_host_ops_that_launched_the_next_kernel():
    trace = {"traceEvents": [
        _x("step:forward", "user_annotation", 0, 1000),
        _x("aten::mm", "cpu_op", 10, 20), _x("cudaLaunchKernel", "cuda_runtime", 15, 5, corr=1),
        _x("gemm", "kernel", 30, 100, corr=1),  # busy 30..130
        _x("_FakeQuant", "cpu_op", 300, 100), _x("cuLaunchKernelEx", "cuda_driver", 380, 5, corr=2),
        _x("pair_kernel", "kernel", 390, 50, corr=2),  # gap 260 us: launched at 380 > 130, the host was late
        _x("aten::add", "cpu_op", 400, 10), _x("cudaLaunchKernel", "cuda_runtime", 405, 2, corr=3),
        _x("add", "kernel", 445, 5, corr=3),  # gap 5 us: under min_us
        _x("Memcpy DtoD", "gpu_memcpy", 440, 20),  # overlaps the add: busy 440..460
        _x("aten::copy_", "cpu_op", 420, 30), _x("cudaMemcpyAsync", "cuda_runtime", 425, 3, corr=4),
        _x("copy", "kernel", 500, 40, corr=4),  # gap 40 us, launched at 425 < 460: not host-late
    ]}
    g = idle_gaps(trace, min_us=20)
    assert g["device_activities"] == 5
    assert g["span_ms"] == 0.51 and g["busy_ms"] == 0.21 and g["idle_ms"] == 0.3
    assert g["gaps_over_min"] == 2 and g["gaps_over_min_ms"] == 0.3 and g["host_late_ms"] == 0.26
    assert g["by_launching_op"][0] == ["_FakeQuant < step:forward", 1, 0.26]
    assert g["top_gaps"][0] == [0.26, "pair_kernel", "_FakeQuant < step:forward", True, "gemm", "step:forward"]
    assert g["top_gaps"][1] == [0.04, "copy", "aten::copy_ < step:forward", False, "Memcpy DtoD", "step:forward"]


def test_host_ops_of_other_threads_are_not_counted_as_enclosing():
    trace = {"traceEvents": [
        _x("gemm", "kernel", 0, 10, corr=1),
        {**_x("autograd::engine", "cpu_op", 50, 100), "tid": 2},  # another thread, overlapping the launch
        {**_x("_FakeQuant", "cpu_op", 60, 40), "tid": 1},
        {**_x("cuLaunchKernelEx", "cuda_driver", 90, 5, corr=2), "tid": 1},
        _x("pair_kernel", "kernel", 100, 10, corr=2),
    ]}
    assert idle_gaps(trace)["top_gaps"][0][2] == "_FakeQuant"


def test_a_trace_without_device_activity():
    assert idle_gaps({"traceEvents": [_x("aten::mm", "cpu_op", 0, 5)]}) == {"device_activities": 0}
