"""Worker of the DDP test (spawned, one process per rank, gloo): Megatron's DDP and distributed optimizer."""

from __future__ import annotations

import os

import torch

from megatron_trace.testing.megatron_cpu import record_errors

STEPS = 3


def ddp_worker(rank: int, world: int, ep: int, port: int, overlap: bool, bucket_size: int, workdir: str) -> None:
    """``STEPS`` FP4 QAT steps of the shared model on batch ``rank`` under Megatron's DDP (distributed optimizer,
    ``overlap_param_gather=overlap``; expert parallel size ``ep``), then one forward; saves the parameters and the
    last logits."""
    with record_errors(workdir, rank):
        _run(rank, world, ep, port, overlap, bucket_size, workdir)


def _run(rank, world, ep, port, overlap, bucket_size, workdir):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_trace.megatron import trace_guidance, trace_spec
    from megatron_trace.testing.megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    from .harness import MegatronOptimizerOnCpu, batch, build_model, ep_state_dict, stock_spec, tiny_config

    torch.set_num_threads(1)
    apply_cpu_shims()
    init_megatron(rank, world, port, ep=ep)
    shared = torch.load(os.path.join(workdir, "shared.pt"), weights_only=False)
    cfg = tiny_config(**shared["config"], expert_model_parallel_size=ep)
    model = build_model(cfg, trace_spec(stock_spec(cfg), shared["trace_config"]))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    model.load_state_dict(ep_state_dict(shared["state_dict"], ep_rank, ep), strict=False)
    ddp = DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True,
        overlap_param_gather=overlap, bucket_size=bucket_size))
    on_cpu = MegatronOptimizerOnCpu()
    with on_cpu:
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=False,
                                                     use_distributed_optimizer=True), [ddp])
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        with on_cpu:
            opt.zero_grad()
        tokens, pos, mask, labels = batch(seed=10 * step + rank)
        with trace_guidance(ddp, None):
            ddp(tokens, pos, mask, labels=labels).float().mean().backward()
        ddp.finish_grad_sync()
        with on_cpu:
            assert opt.step()[0]
    with trace_guidance(ddp, None), torch.no_grad():  # (waits for the last step's all-gathers as it goes)
        out = ddp(*batch(seed=99)[:3])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    name = f"ep{ep}_rank{rank}_overlap{int(overlap)}.pt"
    torch.save({"logits": out, "params": params, "ep_rank": ep_rank}, os.path.join(workdir, name))
    shutdown_megatron()
