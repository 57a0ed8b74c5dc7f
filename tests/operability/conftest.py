import os

import pytest
import torch

from ..megatron.harness import apply_cpu_shims, destroy_parallel, free_port, init_parallel


@pytest.fixture(scope="module")
def world1():
    """A one-process gloo world with Megatron's model-parallel state (TP=EP=1), torn down per module."""
    apply_cpu_shims()
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    init_parallel(ep=1)
    torch.set_num_threads(2)
    yield
    destroy_parallel()
    if created:
        dist.destroy_process_group()
