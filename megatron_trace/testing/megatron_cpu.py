"""Run Megatron-Core 0.16.1 on CPU with gloo: the few shims it needs (tests and the CPU demo only).

Megatron assumes CUDA in a few places (probed in shared/reference/megatron_cpu_probe.py):
  - CUDA RNG state / manual_seed (model_parallel_cuda_manual_seed, the RNG tracker's fork) -> CPU RNG
  - ``device=torch.cuda.current_device()`` at ~40 call sites (RoPE, router, buffers) -> "cpu"
  - ``moe_utils.te_general_gemm`` read unconditionally without Transformer Engine -> None
  - CUDA streams/events of the alltoall dispatcher -> no-op stand-ins (CPU work is synchronous)
  - alltoall split sizes must be numpy for all_to_all_single, done for CUDA tensors only -> also CPU
  - the pipeline schedules' token counter ``torch.zeros([], device="cuda")`` -> on the CPU
  - ``torch.cuda.synchronize()`` after the torch_dist checkpoint writer's host copies (``dist_checkpointing.save``:
    filesystem_async.preload_tensors, "Torch not compiled with CUDA enabled") -> no-op (CPU copies are synchronous)

``apply_cpu_shims()`` is explicit and idempotent; no product module calls it. On a GPU nothing
here is used. Remove a shim when Megatron-Core stops needing it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
import types

import torch

_APPLIED = False


class _CpuEvent:
    def synchronize(self):
        pass


class _CpuStream:
    """Stand-in for torch.cuda.Stream in the alltoall dispatcher."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def record_event(self, *args):
        return _CpuEvent()

    def synchronize(self):
        pass


def apply_cpu_shims() -> None:
    """Route Megatron's CUDA-only calls to CPU equivalents (idempotent; refuses on a CUDA machine)."""
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims() is for CPU-only machines; on a GPU Megatron runs unpatched")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # jit_fuser is torch.compile: slow C++ builds on CPU
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.token_dispatcher as tdisp

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed, *a, **k: torch.manual_seed(seed)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    fix_router_without_te()
    stream = _CpuStream()
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    original = tdisp.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    tdisp.maybe_move_tensor_to_cpu = move_to_cpu
    _schedules_on_cpu()
    _APPLIED = True


class _TorchOnCpu(types.ModuleType):
    """``torch`` as the pipeline schedules see it: ``zeros(..., device="cuda")`` made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _schedules_on_cpu() -> None:
    """The schedules (``forward_backward_func``) make their token counter with a literal ``device="cuda"``."""
    import megatron.core.pipeline_parallel.schedules as schedules

    schedules.torch = _TorchOnCpu("torch")


def fix_router_without_te() -> None:
    """megatron-core 0.16.1 bug, on GPU too: without Transformer Engine the MoE router reads
    ``moe_utils.te_general_gemm``, which is only defined when TE imports (NameError). Define it as None."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def allow_torch_norm_with_sequence_parallel() -> None:
    """TP MoE needs sequence parallelism, which the torch norm refuses (Apex/TE norms accept it): build the
    torch norm from a copy without the flag and tag its parameters like Megatron does."""
    import copy

    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm, "_trace_sp_shim", False):
        return
    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)
    torch_norm.WrappedTorchNorm._trace_sp_shim = True


def spawn_ranks(target, world: int, args_of_rank, timeout: float = 240.0) -> list[int | None]:
    """Run ``target(*args_of_rank(rank))`` in ``world`` spawned processes; join each with ``timeout`` seconds,
    kill what is still alive, and return the exit codes (0 = success; None never, killed ones are negative)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=tuple(args_of_rank(r))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    return [p.exitcode for p in procs]


@contextlib.contextmanager
def record_errors(workdir: str, rank: int):
    """In a ``spawn_ranks`` worker: if the body raises, write the rank's traceback to ``workdir/error{rank}.txt`` (for
    the parent to show) and re-raise."""
    try:
        yield
    except BaseException:
        with open(os.path.join(workdir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(rank: int = 0, world_size: int = 1, port: int | None = None, *, ep: int = 1, tp: int = 1,
                  etp: int = 1, seed: int = 1234, timeout_s: float | None = None) -> bool:
    """gloo process group (if none; collectives time out after ``timeout_s``, torch's default when None) +
    Megatron's model-parallel state; returns whether it created the group."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = not dist.is_initialized()
    if created:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port or free_port())
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    model_parallel_cuda_manual_seed(seed)
    return created


def shutdown_megatron(destroy_group: bool = True) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    parallel_state.destroy_model_parallel()
    RouterReplay.clear_global_router_replay_instances()
    if destroy_group and dist.is_initialized():
        dist.destroy_process_group()
