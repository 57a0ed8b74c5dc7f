"""The deferred NaN/Inf counters on the CPU (``kernels.checks``): counts summed per site, read and reset in one call,
named at the raise; unused counters left out (the side-stream read on CUDA: tests/gpu/test_checks_gpu.py)."""

import pytest
import torch

from megatron_trace.formats import NonFiniteError
from megatron_trace.kernels.checks import FiniteCounter, raise_if_bad, read_and_reset


def test_counts_are_summed_named_and_reset_by_the_read():
    fc1, fc2, unused = FiniteCounter("layer 0 fc1"), FiniteCounter("layer 0 fc2"), FiniteCounter("layer 1 fc1")
    fc1.add_bad(torch.tensor([True, False, True]))
    fc1.add_bad(torch.tensor([[0, 3]], dtype=torch.int64))  # any integer tensor, summed
    fc2.add_bad(torch.tensor(False))
    assert read_and_reset([fc1, unused, fc2]) == [("layer 0 fc1", 5), ("layer 0 fc2", 0)]
    assert read_and_reset([fc1, fc2]) == [("layer 0 fc1", 0), ("layer 0 fc2", 0)]


def test_raise_if_bad_names_each_site_with_a_count():
    fc1, fc2, unused = FiniteCounter("layer 0 fc1"), FiniteCounter("layer 2 kv_v"), FiniteCounter("layer 1 fc1")
    fc1.add_bad(torch.tensor([True]))  # one value: still an error
    fc2.add_bad(torch.tensor([False, False]))
    with pytest.raises(NonFiniteError, match=r"held NaN/Inf at step 3 \(layer 0 fc1: 1 NaN/Inf value\(s\)\); FP4"):
        raise_if_bad([unused, fc1, fc2], when="at step 3")
    raise_if_bad([unused, fc1, fc2])  # the read reset the count
    fc2.add_bad(torch.tensor(7))
    with pytest.raises(NonFiniteError, match=r"held NaN/Inf \(layer 2 kv_v: 7 NaN/Inf"):
        raise_if_bad([fc1, fc2], counts=None)


def test_a_counter_lives_on_the_device_it_is_asked_for():
    """A site whose producer moves (another device) gets a counter there, not the old one."""
    c = FiniteCounter("x")
    assert c.tensor("cpu").device.type == "cpu"
    meta = c.tensor("meta")
    assert meta.device.type == "meta" and meta.dtype == torch.int64 and meta.shape == (1,)
