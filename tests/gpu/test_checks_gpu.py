"""The deferred NaN/Inf check reads its counters after the kernels that counted, not after the whole stream
(``checks.ReadyPoint``; CUDA only, skipped elsewhere): a long kernel queued after the quantize is still running when
the check returns, the counts are right, and a producer that did not mark makes the read wait for the stream.
Each timed read follows a warm-up read (``_warm``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
    pytest.skip("needs CUDA and triton", allow_module_level=True)

from megatron_trace.formats import NonFiniteError, Quantizer  # noqa: E402
from megatron_trace.kernels import fused  # noqa: E402
from megatron_trace.kernels.checks import FiniteCounter, ReadyPoint, host_values, raise_if_bad  # noqa: E402

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 3_000_000_000  # ~1.5 s of one spinning kernel: far longer than a read


def _warm(read) -> None:
    """Run a read once before the timed one: a process's first read allocates the pinned buffer, and the first
    launch of each kernel loads its module (CUDA's lazy loading); both wait for the device."""
    try:
        read()
    except NonFiniteError:
        pass
    torch.cuda.synchronize()


def _busy() -> torch.cuda.Event:
    """Queue a long kernel on the current stream; an event recorded after it."""
    torch.cuda._sleep(SLEEP_CYCLES)
    done = torch.cuda.Event()
    done.record()
    return done


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nan"])
def test_check_reads_the_counter_without_waiting_for_later_work(bad):
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    if bad:
        x[3, 17] = float("nan")
    counter = FiniteCounter("layer 0 expert_fc1_in")
    q = Quantizer("nvfp4", per_row=True)
    fused.fake_quantize(x[:, :16].contiguous(), q, check_finite=counter)  # warm-up (see _warm)
    _warm(lambda: raise_if_bad([counter]))
    fused.fake_quantize(x, q, check_finite=counter)
    done = _busy()
    if bad:
        with pytest.raises(NonFiniteError, match="layer 0 expert_fc1_in: 1 NaN"):
            raise_if_bad([counter])
    else:
        raise_if_bad([counter])
    assert not done.query()  # the read did not wait for the long kernel
    torch.cuda.synchronize()
    raise_if_bad([counter])  # reset by the read


def test_an_unmarked_producer_makes_the_read_wait_for_the_stream():
    counter = FiniteCounter("kv")
    counter.tensor("cuda").add_(2)  # a producer that does not mark (e.g. the KV cache's mask-hole count)
    done = _busy()
    with pytest.raises(NonFiniteError, match="kv: 2"):
        raise_if_bad([counter])
    assert done.query()


def test_host_values_after_a_ready_point_sees_the_values_at_that_point():
    t = torch.zeros(1, dtype=torch.int64, device="cuda")
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    t.add_(5)
    flag.fill_(True)
    point = ReadyPoint()
    point.mark("cuda")
    _warm(lambda: host_values([t, flag], ready=[point]))
    point.mark("cuda")
    done = _busy()
    assert host_values([t, flag], ready=[point]) == [5, 1]
    assert not done.query()
    torch.cuda.synchronize()
