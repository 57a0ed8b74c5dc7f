import pytest
import torch.distributed as dist

from ._megatron_cpu import apply_cpu_shims, free_port, init_megatron, shutdown_megatron


@pytest.fixture(scope="package")
def megatron_world1():
    """A single-rank gloo world with Megatron's parallel state (TP=EP=1) and the CPU shims."""
    if dist.is_initialized():
        pytest.skip("a torch.distributed process group is already initialised in this process")
    apply_cpu_shims()
    init_megatron(0, 1, free_port())
    try:
        yield
    finally:
        shutdown_megatron()
