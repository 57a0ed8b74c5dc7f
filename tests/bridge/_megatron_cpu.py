"""Test-only: run Megatron-Core 0.16.1 on CPU (gloo). Never imported by product code.

Megatron assumes CUDA in a few places (see shared/reference/megatron_cpu_probe.py); the shims
below are applied through a ``pytest.MonkeyPatch`` so they are undone after the fixture:
  - CUDA RNG state / manual_seed -> the CPU RNG (model_parallel_cuda_manual_seed)
  - torch.cuda.current_device() -> "cpu" (RoPE, router, buffers)
  - moe_utils.te_general_gemm = None (read unconditionally without Transformer Engine)
  - CUDA streams/events of the alltoall dispatcher -> no-op stand-ins
  - alltoall split sizes -> numpy also for CPU tensors (EP > 1)
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist


class _CpuEvent:
    def synchronize(self):
        pass


class _CpuStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def record_event(self, *args):
        return _CpuEvent()

    def synchronize(self):
        pass


def apply_cpu_shims(mp: pytest.MonkeyPatch) -> None:
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as tdisp

    mp.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    mp.setattr(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    mp.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    mp.setattr(torch.cuda, "manual_seed", lambda seed, *a, **k: torch.manual_seed(seed))
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    if not hasattr(moe_utils, "te_general_gemm"):
        mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
    stream = _CpuStream()
    mp.setattr(torch.cuda, "Stream", _CpuStream)
    mp.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    mp.setattr(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    orig = tdisp.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    mp.setattr(tdisp, "maybe_move_tensor_to_cpu", move_to_cpu)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(rank: int, world_size: int, port: int, *, ep: int = 1, tp: int = 1, seed: int = 1234) -> None:
    """gloo process group + Megatron model-parallel state (call after ``apply_cpu_shims``)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(seed)


def shutdown_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-sequence causal forward of a GPTModel: tokens [B, S] -> logits [B, S, V]."""
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True = masked
    with torch.no_grad():
        return model(tokens, pos, mask)
