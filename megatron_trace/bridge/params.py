"""The bridge's reads of a wrapped model's parameters: current (Megatron DDP's distributed optimizer gathers them),
whole (torch FSDP2's shards gathered; Megatron-FSDP's refused), and loading refused into sharded parameters."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def gather_params(model) -> None:
    """Make ``model``'s parameters current on this rank before they are read. Megatron's DDP with the distributed
    optimizer and ``overlap_param_gather`` leaves them stale after ``optimizer.step()``: the step updates this
    rank's shard of each bucket and the all-gather of the others runs in the next forward's pre-hooks, so an export
    between the two would read the other ranks' shards as they were before the step (different on every rank).
    All-gather them now, synchronously, as Megatron-LM does before a checkpoint save
    (``disable_forward_pre_hook(param_sync=True)``); every rank exports, so every rank joins. Each bucket group's
    ``param_gather_dispatched`` is then put back as it was: the sync sets it, and an export between the gradient
    sync and ``optimizer.step()`` would otherwise make the next forward's pre-hooks skip the all-gather of the
    step's update (that forward computed with the other ranks' shards as they were before the step). The next
    forward's pre-hooks gather again where they would have without the export. (torch FSDP2's sharded parameters
    are gathered as they are read, ``_whole``; Megatron-FSDP's are refused there.)"""
    from megatron.core.distributed import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and model.use_forward_hook:
        groups = model.bucket_groups + model.expert_parallel_bucket_groups
        dispatched = [g.param_gather_dispatched for g in groups]
        model.start_param_sync(force_sync=True)
        for group, was in zip(groups, dispatched):
            group.param_gather_dispatched = was


def exported_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """named_parameters, plus the router's expert_bias (a buffer, so only in the state dict). A parameter sharded by
    torch FSDP2 (a DTensor outside a forward) is gathered whole (every rank joins); Megatron-FSDP's are refused."""
    seen = set()
    for name, param in model.named_parameters():
        seen.add(name)
        yield name, _whole(name, param)
    state = model.state_dict()
    yield from ((k, v) for k, v in state.items() if "expert_bias" in k and "_extra_state" not in k and k not in seen)


def refuse_sharded(model) -> None:
    """A model whose parameters a sharded data-parallel wrapper holds (torch FSDP2's DTensor shards, Megatron-FSDP's
    parameters) is not loaded into: torch raised "aten.copy_.default got mixed torch.Tensor and DTensor" at the first
    parameter. Every rank of such a model has them, so every rank raises."""
    from torch.distributed.tensor import DTensor

    name, param = next(((n, p) for n, p in model.named_parameters()
                        if isinstance(p, DTensor) or getattr(p, "__fsdp_param__", False)), (None, None))
    if name is not None:
        raise ValueError(f"load_weights: the model's parameters are sharded by a data-parallel wrapper ({name} is a "
                         f"{type(param).__name__} of shape {tuple(param.shape)}): load the HF checkpoint into the "
                         "model before wrapping it (fully_shard, Megatron's FSDP wrappers)")


def _whole(name: str, param: torch.Tensor) -> torch.Tensor:
    """``param`` whole: a torch FSDP2 shard (DTensor) all-gathered; Megatron-FSDP's parameters (marked
    ``__fsdp_param__``, unevenly sharded outside a forward) refused by name."""
    from torch.distributed.tensor import DTensor

    if getattr(param, "__fsdp_param__", False):
        raise ValueError(f"export of {name}: Megatron-FSDP's parameters (--use-megatron-fsdp) are not exported: "
                         "use Megatron's DDP (with --use-distributed-optimizer) or torch FSDP2 (--use-torch-fsdp2)")
    return param.full_tensor() if isinstance(param, DTensor) else param
