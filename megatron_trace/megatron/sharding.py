"""Sharded data parallelism around TRACE's experts: what works and what is refused by name.

torch FSDP2 (``fully_shard``, Megatron's ``TorchFullyShardedDataParallel``) gathers a ``TransformerLayer``'s
parameters in its forward pre-hook, so the torch experts, which read their linears' weights inside the layer's
forward without calling the linears, fake-quantize the whole weights: the forward, its records and counts, and the
gradients equal the unwrapped model's (tests/megatron/test_fsdp.py). Outside a forward the parameters are DTensor
shards. Two uses are refused:

- FSDP2 sharding the routed experts over ranks that hold other experts: Megatron's ``TorchFullyShardedDataParallel``
  shards every parameter over the data-parallel group, which with expert parallelism spans the expert-parallel ranks;
  each rank's local experts are then cut and joined with another rank's (wrong weights, no error).
- Megatron-FSDP (``--use-megatron-fsdp``): it needs CUDA and cannot be run against the unwrapped model here, so its
  equality is not established; it marks its parameters ``__fsdp_param__``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

MEGATRON_FSDP_REFUSED = (
    "TRACE does not support Megatron-FSDP (--use-megatron-fsdp, megatron.core.distributed.fsdp): it runs on CUDA "
    "only and TRACE's experts (which read their linears' weights without calling them), weight reuse and weight "
    "export are not verified against it. Use Megatron's DDP with the distributed optimizer "
    "(--use-distributed-optimizer), or torch FSDP2 (--use-torch-fsdp2) without expert parallelism")


def is_sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a parameter of a sharded data-parallel wrapper as it is outside a forward: a DTensor
    (torch FSDP2, Megatron-FSDP) or marked by Megatron-FSDP."""
    return isinstance(weight, DTensor) or bool(getattr(weight, "__fsdp_param__", False))


def check_expert_sharding(experts, where: str) -> None:
    """Raise where the experts module ``experts`` (one MoE layer's, named ``where``) is sharded in a way TRACE
    refuses (module docstring). One of its parameters is looked at (they are wrapped together)."""
    weight = next(experts.parameters(), None)
    if weight is None or not is_sharded(weight):
        return
    if getattr(weight, "__fsdp_param__", False):
        raise ValueError(f"{where}: {MEGATRON_FSDP_REFUSED}")
    outside = _ranks_holding_other_experts(weight, experts)
    if outside:
        raise ValueError(
            f"{where}: the routed experts' weights are sharded (torch FSDP2) over ranks {outside}, which hold "
            f"other experts (expert_model_parallel_size={_ep_size(experts)}): each forward would join this rank's "
            "experts with theirs. Shard the experts over the expert-data-parallel group only, or use Megatron's "
            "DDP with the distributed optimizer; Megatron-LM's --use-torch-fsdp2 shards them over the whole "
            "data-parallel group: use it with --expert-model-parallel-size 1")


def _ranks_holding_other_experts(weight: DTensor, experts) -> list[int]:
    """The ranks of ``weight``'s device mesh outside this rank's expert-data-parallel group (the ranks with the
    same local experts); none where the group is unknown and there is no expert parallelism."""
    mesh_ranks = sorted(int(r) for r in weight.device_mesh.mesh.flatten().tolist())
    group = _expert_dp_group(experts)
    if group is None:
        return [] if _ep_size(experts) == 1 else [r for r in mesh_ranks if r != dist.get_rank()]
    same = set(dist.get_process_group_ranks(group))
    return [r for r in mesh_ranks if r not in same]


def _expert_dp_group(experts):
    pg = getattr(experts, "_trace_pg", None)
    group = getattr(pg, "expt_dp", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_group(check_initialized=False)


def _ep_size(experts) -> int:
    pg = getattr(experts, "_trace_pg", None)
    ep = getattr(pg, "ep", None)
    return ep.size() if ep is not None else 1
