"""Worker of the pipeline-parallel tests (spawned, one process per rank, gloo): Megatron's own schedule (1F1B,
or interleaved with virtual stages) inside one ``trace_guidance`` context given one StepGuidance per micro-batch."""

from __future__ import annotations

import os
import re

import torch

from megatron_trace.testing.megatron_cpu import record_errors


def pp_worker(rank: int, world: int, port: int, vpp: int | None, recompute: str, workdir: str,
              stages: dict | None = None) -> None:
    """``stages``: TransformerConfig fields of the stage split (``num_layers_in_first_pipeline_stage``, ...)."""
    with record_errors(workdir, rank):
        _run(rank, world, port, vpp, recompute, workdir, stages or {})


def global_name(chunk, name: str) -> str:
    """A stage's parameter name as the whole model (PP=1) names it: its layers by their global layer id."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m is None:
        return name
    return f"decoder.layers.{chunk.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"


def _run(rank, world, port, vpp, recompute, workdir, stages):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_trace.megatron import StepGuidance, trace_guidance, trace_spec

    from .harness import SEQ, VOCAB, apply_cpu_shims, destroy_parallel, tiny_config
    from .test_microbatches import RECOMPUTE, TC, forward_step

    torch.set_num_threads(1)
    apply_cpu_shims()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world,
                                             virtual_pipeline_model_parallel_size=vpp)
    model_parallel_cuda_manual_seed(1234)
    shared = torch.load(os.path.join(workdir, "shared.pt"), weights_only=False)
    cfg = tiny_config(pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vpp,
                      batch_p2p_comm=False, **RECOMPUTE[recompute], **stages)
    chunks = []
    for vp in range(vpp) if vpp else [None]:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp)
        chunk = GPTModel(
            config=cfg, transformer_layer_spec=trace_spec(spec, TC), vocab_size=VOCAB, max_sequence_length=SEQ,
            position_embedding_type="rope", vp_stage=vp,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp))
        full = shared["state_dict"]
        chunk.load_state_dict({k: full[global_name(chunk, k)] for k in chunk.state_dict()}, strict=True)
        chunks.append(chunk)
    micro = shared["micro"]
    steps = [StepGuidance(**g) for g in shared["steps"]]
    with trace_guidance(chunks, steps, record=True, compact=False) as h:
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(micro) for _ in chunks] if vpp else iter(micro),
            model=chunks, num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=2, forward_only=False)
    grads = {global_name(c, n): p.grad for c in chunks for n, p in c.named_parameters() if p.grad is not None}
    layers = sorted(c.decoder.layers[i].layer_number - 1 for c in chunks for i in range(len(c.decoder.layers)))
    out = {"layers": layers, "grads": grads, "recorded": [h.microbatch(i).recorded() for i in range(len(micro))],
           "stats": h.stats()}
    torch.save(out, os.path.join(workdir, f"rank{rank}.pt"))
    destroy_parallel()
    dist.destroy_process_group()
