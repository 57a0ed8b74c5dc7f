"""Worker of the expert-parallel tests (spawned, one process per rank, gloo)."""

from __future__ import annotations

import os

import torch

from megatron_trace.testing.megatron_cpu import record_errors


def _join(rank: int, world: int, port: int) -> None:
    """One thread, Megatron's CPU shims, and this rank in a gloo group of ``world`` on ``port``."""
    import torch.distributed as dist

    from megatron_trace.testing.megatron_cpu import apply_cpu_shims

    torch.set_num_threads(1)
    apply_cpu_shims()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def ep_worker(rank: int, world: int, port: int, dispatcher: str, workdir: str) -> None:
    """EP=world: load the EP=1 weights, run RNE+record and guided+record on batch ``rank``, save results."""
    with record_errors(workdir, rank):
        _run(rank, world, port, dispatcher, workdir)


def _run(rank, world, port, dispatcher, workdir):
    import torch.distributed as dist

    from megatron_trace.megatron import StepGuidance, trace_guidance, trace_spec

    from .harness import (
        batch,
        build_model,
        destroy_parallel,
        ep_state_dict,
        init_parallel,
        stock_spec,
        tiny_config,
    )

    _join(rank, world, port)
    init_parallel(ep=world)
    shared = torch.load(os.path.join(workdir, "shared.pt"), weights_only=False)
    cfg = tiny_config(moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=world)
    model = build_model(cfg, trace_spec(stock_spec(cfg), shared["trace_config"]))
    model.load_state_dict(ep_state_dict(shared["state_dict"], rank, world), strict=True)
    tokens, pos, mask, _ = batch(seed=rank)
    out = {}
    for name, per_rank in shared["modes"].items():
        step = None if per_rank[rank] is None else StepGuidance(**per_rank[rank])
        with trace_guidance(model, step, record=True, compact=False) as h, torch.no_grad():
            logits = model(tokens, pos, mask)
        out[name] = {"logits": logits, "recorded": h.recorded(), "counter": h.counter}
    # per-tensor FC1 amax: carried from each token's source rank inside the context, refused outside it
    model = build_model(cfg, trace_spec(stock_spec(cfg), shared["per_tensor_fc1"]))
    model.load_state_dict(ep_state_dict(shared["state_dict"], rank, world), strict=True)
    with torch.no_grad():
        try:
            model(tokens, pos, mask)
        except ValueError as e:
            out["per_tensor_fc1_error"] = str(e)
        with trace_guidance(model, None):
            out["per_tensor_fc1"] = model(tokens, pos, mask)
    torch.save(out, os.path.join(workdir, f"rank{rank}.pt"))
    destroy_parallel()
    dist.destroy_process_group()


def packed_worker(rank: int, world: int, port: int, parallel: str, workdir: str) -> None:
    """Packed (THD) micro-batches of the ``mrope`` model: ``parallel`` "alltoall" / "allgather" (EP=world with that
    dispatcher, the EP=1 weights, each rank its own samples: the packed forward of its row guided by its packed
    step; logits, records and counter saved) or "tp" (TP=world with sequence parallelism, the same samples on every
    rank: the padded and the packed forward, each guided by its step; this rank's logits at the samples' tokens and
    its counter saved for each)."""
    with record_errors(workdir, rank):
        _run_packed(rank, world, port, parallel, workdir)


def _run_packed(rank, world, port, parallel, workdir):
    import torch.distributed as dist

    from megatron_trace.megatron import trace_guidance, trace_spec

    from .harness import (
        MROPE_SECTION,
        allow_torch_norm_with_sequence_parallel,
        build_model,
        destroy_parallel,
        ep_state_dict,
        init_parallel,
        stock_spec,
        tiny_config,
    )

    _join(rank, world, port)
    shared = torch.load(os.path.join(workdir, "shared.pt"), weights_only=False)
    if parallel == "tp":
        allow_torch_norm_with_sequence_parallel()
        init_parallel(tp=world)
        cfg = tiny_config(tensor_model_parallel_size=world, sequence_parallel=True, expert_tensor_parallel_size=1,
                          mrope_section=MROPE_SECTION)
    else:
        init_parallel(ep=world)
        cfg = tiny_config(moe_token_dispatcher_type=parallel, expert_model_parallel_size=world,
                          mrope_section=MROPE_SECTION)
    model = build_model(cfg, trace_spec(stock_spec(cfg), shared["trace_config"]), position_embedding_type="mrope")
    out = {}
    if parallel == "tp":  # (CPU init: TP=1's weights)
        for name, (step, data, rows) in shared["runs"].items():
            with trace_guidance(model, step) as h, torch.no_grad():
                logits = model(*data)
            out[name] = {"logits": logits.reshape(-1, logits.shape[-1])[rows], "counter": h.counter}
    else:
        model.load_state_dict(ep_state_dict(shared["state_dict"], rank, world), strict=True)
        with trace_guidance(model, shared["steps"][rank], record=True) as h, torch.no_grad():
            logits = model(*shared["data"][rank])
        out = {"logits": logits, "recorded": h.recorded(), "counter": h.counter}
    torch.save(out, os.path.join(workdir, f"rank{rank}.pt"))
    destroy_parallel()
    dist.destroy_process_group()


def tp_worker(rank: int, world: int, port: int, workdir: str) -> None:
    """TP=world with sequence parallelism (EP=1): guided forward on batch 0, logits saved."""
    with record_errors(workdir, rank):
        _run_tp(rank, world, port, workdir)


def _run_tp(rank, world, port, workdir):
    import dataclasses

    import torch.distributed as dist

    from megatron_trace.config import KV_SITES, TraceConfig
    from megatron_trace.megatron import StepGuidance, trace_guidance, trace_spec

    from .harness import (
        allow_torch_norm_with_sequence_parallel,
        apply_cpu_shims,
        batch,
        build_model,
        destroy_parallel,
        init_parallel,
        stock_spec,
        tiny_config,
    )

    torch.set_num_threads(1)
    apply_cpu_shims()
    allow_torch_norm_with_sequence_parallel()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    init_parallel(tp=world)
    shared = torch.load(os.path.join(workdir, "shared.pt"), weights_only=False)
    cfg = tiny_config(tensor_model_parallel_size=world, sequence_parallel=True, expert_tensor_parallel_size=1,
                      num_query_groups=shared["groups"])
    model = build_model(cfg, trace_spec(stock_spec(cfg), shared["trace_config"]))  # CPU init: TP=1's weights
    model.eval()
    tokens, pos, mask, _ = batch(seed=0)
    out = {}
    for name, step in (("rne", StepGuidance(routing=shared["guidance"]["routing"])),
                       ("guided", StepGuidance(**shared["guidance"])),
                       ("masked", StepGuidance(**shared["guidance"], token_mask=shared["token_mask"])),
                       ("kv_invalid", StepGuidance(**shared["kv_invalid"]))):
        with trace_guidance(model, step) as h, torch.no_grad():
            out[name] = {"logits": model(tokens, pos, mask), "counter": h.counter}
    kv_only = TraceConfig(sites=KV_SITES, guided_sites=KV_SITES)  # (MoE layers refuse recording under TP on their own)
    moe_only = TraceConfig(sites=("expert_fc1_in", "expert_fc2_in"), guided_sites=("expert_fc1_in", "expert_fc2_in"))
    for name, tc, record in (("record_error", kv_only, True), ("moe_record_error", moe_only, True),
                             ("per_tensor_error", dataclasses.replace(kv_only, activation_amax="per_tensor"), False)):
        try:
            with trace_guidance(build_model(cfg, trace_spec(stock_spec(cfg), tc)), None, record=record):
                pass
        except ValueError as e:
            out[name] = str(e)
    torch.save(out, os.path.join(workdir, f"rank{rank}.pt"))
    destroy_parallel()
    dist.destroy_process_group()


def features_worker(rank: int, world: int, port: int, workdir: str) -> None:
    """EP=world, the model of ``shared["config"]`` (Megatron MoE features) with the EP=1 weights: each guidance mode's
    forward on batch ``rank`` (guided + recorded), logits, records and counter saved."""
    with record_errors(workdir, rank):
        _run_features(rank, world, port, workdir)


def _run_features(rank, world, port, workdir):
    import torch.distributed as dist

    from megatron_trace.megatron import StepGuidance, trace_guidance, trace_spec

    from .harness import batch, build_model, destroy_parallel, ep_state_dict, init_parallel, stock_spec, tiny_config

    _join(rank, world, port)
    init_parallel(ep=world)
    shared = torch.load(os.path.join(workdir, "shared.pt"), weights_only=False)
    cfg = tiny_config(expert_model_parallel_size=world, **shared["config"])
    model = build_model(cfg, trace_spec(stock_spec(cfg), shared["trace_config"]))
    model.load_state_dict(ep_state_dict(shared["state_dict"], rank, world), strict=True)
    tokens, pos, mask, _ = batch(seed=rank)
    out = {}
    for name, per_rank in shared["modes"].items():
        step = None if per_rank is None else StepGuidance(**per_rank[rank])
        with trace_guidance(model, step, record=True, compact=False) as h, torch.no_grad():
            logits = model(tokens, pos, mask)
        out[name] = {"logits": logits, "recorded": h.recorded(), "counter": h.counter}
    torch.save(out, os.path.join(workdir, f"rank{rank}.pt"))
    destroy_parallel()
    dist.destroy_process_group()
