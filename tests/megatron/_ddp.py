"""Worker of the DDP test (spawned, one process per rank, gloo): Megatron's DDP and distributed optimizer."""

from __future__ import annotations

import os

import torch

from megatron_trace.testing.megatron_cpu import record_errors

STEPS = 2


def ddp_worker(rank: int, world: int, ep: int, port: int, bucket_size: int, workdir: str) -> None:
    """``STEPS`` FP4 QAT steps of the shared model on batch ``rank`` under Megatron's DDP (distributed optimizer;
    expert parallel size ``ep``) without and with ``overlap_param_gather``, each from the shared weights and followed
    by one forward; saves both runs' parameters and last logits."""
    with record_errors(workdir, rank):
        _run(rank, world, ep, port, bucket_size, workdir)


def _run(rank, world, ep, port, bucket_size, workdir):
    from megatron.core import parallel_state

    from megatron_trace.megatron import trace_guidance, trace_spec
    from megatron_trace.testing.megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    from .harness import MegatronTraining, batch, build_model, ep_state_dict, stock_spec, tiny_config

    torch.set_num_threads(1)
    apply_cpu_shims()
    init_megatron(rank, world, port, ep=ep)
    shared = torch.load(os.path.join(workdir, "shared.pt"), weights_only=False)
    cfg = tiny_config(**shared["config"], expert_model_parallel_size=ep)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    out = {"ep_rank": ep_rank}
    for overlap in (False, True):
        model = build_model(cfg, trace_spec(stock_spec(cfg), shared["trace_config"]))
        model.load_state_dict(ep_state_dict(shared["state_dict"], ep_rank, ep), strict=False)
        training = MegatronTraining(model, cfg, overlap=overlap, bucket_size=bucket_size)
        for step in range(STEPS):
            data = batch(seed=10 * step + rank)
            training.step(lambda m, d=data: m(*d[:3], labels=d[3]).float().mean(),
                          within=lambda m: trace_guidance(m, None))
        with trace_guidance(training.ddp, None), torch.no_grad():  # (waits for the last step's all-gathers)
            logits = training.ddp(*batch(seed=99)[:3])
        out[overlap] = {"logits": logits, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    torch.save(out, os.path.join(workdir, f"ep{ep}_rank{rank}.pt"))
    shutdown_megatron()
