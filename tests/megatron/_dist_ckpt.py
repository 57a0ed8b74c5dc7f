"""Megatron-LM's distributed-checkpoint save and load (``--ckpt-format torch_dist``, its default parallel save), and
the worker of the resharding test (spawned, one process per rank, gloo, EP=world)."""

from __future__ import annotations

import os

import torch

from megatron_trace.testing.megatron_cpu import record_errors


def save_like_megatron_lm(model, path) -> None:
    """What Megatron-LM's ``save_checkpoint`` does with the model's part: ``sharded_state_dict`` with its metadata,
    saved by the torch_dist strategy wrapped in ``FullyParallelSaveStrategyWrapper`` (on unless
    ``--no-ckpt-fully-parallel-save``). Every rank calls it with the same existing directory."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True, "dp_cp_group": dp_cp}
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp_cp, False)
    dist_checkpointing.save(model.sharded_state_dict(metadata=metadata), str(path), strategy)


def load_like_megatron_lm(model, path, fully_parallel: bool = False) -> None:
    """Megatron-LM's ``load_checkpoint``, stricter: any key missing or unexpected on either side raises, then
    ``load_state_dict`` strict. ``fully_parallel``: with ``--ckpt-fully-parallel-load`` (the data-parallel ranks
    each read a part and exchange the rest; its exchange buffers are made on CUDA outright: ``CudaOnCpu``)."""
    from contextlib import nullcontext

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from .harness import CudaOnCpu

    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True, "dp_cp_group": dp_cp}
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)), dp_cp) \
        if fully_parallel else None
    with CudaOnCpu() if fully_parallel else nullcontext():
        state = dist_checkpointing.load(model.sharded_state_dict(metadata=metadata), str(path),
                                        sharded_strategy=strategy, strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(state, strict=True)


def reshard_worker(rank: int, world: int, port: int, workdir: str) -> None:
    """At EP=world: save the reference weights from a stock and a TRACE model (``stock_ep2``, ``trace_ep2``), load the
    EP=1 checkpoints into the other kind (the TRACE model's load fully parallel: the ranks are data-parallel for
    every non-expert tensor), and save what each rank holds after the loads and its logits."""
    with record_errors(workdir, rank):
        _run(rank, world, port, workdir)


def _run(rank, world, port, workdir):
    from megatron_trace.megatron import trace_guidance, trace_spec
    from megatron_trace.testing.megatron_cpu import init_megatron, shutdown_megatron

    from .harness import apply_cpu_shims, batch, build_model, ep_state_dict, stock_spec, tiny_config

    torch.set_num_threads(1)
    apply_cpu_shims()
    init_megatron(rank, world, port, ep=world)
    shared = torch.load(os.path.join(workdir, "shared.pt"), weights_only=False)
    cfg = tiny_config(expert_model_parallel_size=world, **shared["config"])
    specs = {"stock": stock_spec(cfg), "trace": trace_spec(stock_spec(cfg), shared["trace_config"])}
    mine = ep_state_dict(shared["state_dict"], rank, world)
    for kind, spec in specs.items():  # EP=2 checkpoints of the reference weights
        model = build_model(cfg, spec, seed=5)
        model.load_state_dict(mine, strict=True)
        save_like_megatron_lm(model, os.path.join(workdir, f"{kind}_ep{world}"))
    out = {}
    for kind, source in (("trace", "stock"), ("stock", "trace")):  # EP=1 checkpoints of the other kind, loaded here
        model = build_model(cfg, specs[kind], seed=7)
        load_like_megatron_lm(model, os.path.join(workdir, f"{source}_ep1"), fully_parallel=kind == "trace")
        out[kind] = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
        if kind == "trace":
            tokens, pos, mask, _ = batch(seed=rank)
            with trace_guidance(model, None), torch.no_grad():
                out["trace_logits"] = model(tokens, pos, mask)
    torch.save(out, os.path.join(workdir, f"rank{rank}.pt"))
    shutdown_megatron()
