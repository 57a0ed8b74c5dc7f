"""Worker of the torch FSDP2 tests (spawned, one process per rank, gloo): a TRACE model sharded as Megatron's
``TorchFullyShardedDataParallel`` shards it, against the same model unwrapped on every rank."""

from __future__ import annotations

import os

import torch

from megatron_trace.testing.megatron_cpu import record_errors

LR = 1e-2


def fully_shard_as_megatron(model, group) -> None:
    """What Megatron's ``TorchFullyShardedDataParallel`` does for ``transformer_impl="local"``: ``fully_shard`` each
    TransformerLayer, LanguageModelEmbedding and RotaryEmbedding, then the root, over ``group``. (Its class builds a
    CUDA device mesh; here the mesh is on the CPU.)"""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for m in list(model.modules()):
        if isinstance(m, (TransformerLayer, LanguageModelEmbedding, RotaryEmbedding)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp2_worker(rank: int, world: int, ep: int, port: int, workdir: str) -> None:
    """EP 1: the unwrapped model and the FSDP2-wrapped one (same weights) side by side: a recorded forward, a guided
    one, gradients (the unwrapped model's: of the mean loss over every rank's batch, as data parallelism computes
    them), one Adam step and the forward after it; ``reuse_weight_quant`` on the wrapped model. EP ``ep`` > 1: the
    error of a step on a model whose experts FSDP2 shards over the data-parallel group."""
    with record_errors(workdir, rank):
        out = _run(rank, world, ep, port)
        torch.save(out, os.path.join(workdir, f"rank{rank}.pt"))


def _run(rank, world, ep, port):
    from megatron.core import parallel_state

    from megatron_trace.config import TraceConfig
    from megatron_trace.megatron import trace_guidance, trace_spec
    from megatron_trace.testing.megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    from .harness import build_model, stock_spec, tiny_config

    torch.set_num_threads(1)
    apply_cpu_shims()
    init_megatron(rank, world, port, ep=ep)
    dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    cfg = tiny_config(params_dtype=torch.float32, bf16=False, pipeline_dtype=torch.float32,
                      expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather")
    tc = TraceConfig(guided_layers="all")
    model = build_model(cfg, trace_spec(stock_spec(cfg), tc))
    try:
        if ep == 1:
            return _compare(rank, world, cfg, tc, model, dp)
        fully_shard_as_megatron(model, dp)
        with trace_guidance(model, None):
            return {}
    except ValueError as e:
        return {"error": str(e)}
    finally:
        shutdown_megatron()


def _compare(rank, world, cfg, tc, wrapped, dp):
    from megatron_trace.megatron import StepGuidance, reuse_weight_quant, trace_spec

    from .harness import batch, build_model, perturb_non_experts, stock_spec

    ref = build_model(cfg, trace_spec(stock_spec(cfg), tc))
    rollout = build_model(cfg, trace_spec(stock_spec(cfg), tc))
    perturb_non_experts(rollout, 0.01)
    fully_shard_as_megatron(wrapped, dp)
    data = batch(seed=rank)
    roll = _forward(rollout, data)["recorded"]
    guided = StepGuidance(sites=roll.sites, routing=roll.routing)
    out = {"sharded": type(wrapped.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight).__name__}
    for name, step in (("plain", None), ("guided", guided)):
        out[name] = {"ref": _forward(ref, data, step), "fsdp": _forward(wrapped, data, step)}
    for r in range(world):  # the data-parallel gradient: the mean loss over all ranks' batches
        _backward(ref, batch(seed=r), world)
    _backward(wrapped, data, 1)
    out["grads"] = {n: (p.grad, q.grad.full_tensor()) for (n, p), (_, q) in _pairs(ref, wrapped)}
    for m in (ref, wrapped):
        opt = torch.optim.Adam(m.parameters(), lr=LR)
        opt.step()
    out["params"] = {n: (p.detach().clone(), q.full_tensor()) for (n, p), (_, q) in _pairs(ref, wrapped)}
    after = batch(seed=99)
    out["after"] = {"ref": _forward(ref, after), "fsdp": _forward(wrapped, after)}
    try:
        with reuse_weight_quant(wrapped):
            pass
    except ValueError as e:
        out["reuse_error"] = str(e)
    return out


def _pairs(ref, wrapped):
    pairs = list(zip(ref.named_parameters(), wrapped.named_parameters()))
    assert all(a[0] == b[0] for a, b in pairs) and len(pairs) == len(list(ref.parameters()))
    return pairs


def _forward(model, data, step=None):
    from megatron_trace.megatron import trace_guidance

    with trace_guidance(model, step, record=True, compact=False) as h, torch.no_grad():
        logits = model(*data[:3])
    return {"logits": logits, "recorded": h.recorded(), "counter": h.counter}


def _backward(model, data, divide: int) -> None:
    from megatron_trace.megatron import trace_guidance

    with trace_guidance(model, None):
        (model(*data[:3], labels=data[3]).float().mean() / divide).backward()
