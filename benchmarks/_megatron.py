"""Megatron set-up shared by the Megatron benchmarks: a one-process world and a MoE GPTModel of given size.

CUDA: NCCL, Megatron unpatched except ``te_general_gemm`` (Megatron-Core 0.16.1 reads it in the router
without Transformer Engine). CPU (``--smoke``): gloo and the test-only CPU shims.
"""

from __future__ import annotations

import os

import torch

from megatron_trace.testing.megatron_cpu import free_port  # noqa: E402,F401  (re-exported)


def init_world(device: str, seed: int = 1234) -> None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # Megatron's jit_fuser: eager (no inductor builds)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if device == "cuda":
        from megatron_trace.testing.megatron_cpu import fix_router_without_te

        fix_router_without_te()
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        from megatron_trace.testing.megatron_cpu import apply_cpu_shims

        apply_cpu_shims()
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)


def moe_config(a, device: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.moe_ffn, moe_ffn_hidden_size=a.moe_ffn,
        num_attention_heads=a.heads, num_query_groups=a.groups, kv_channels=a.hidden // a.heads,
        num_moe_experts=a.experts, moe_router_topk=a.topk, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_enable_routing_replay=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        use_cpu_initialization=device != "cuda", params_dtype=torch.bfloat16, bf16=True,
        pipeline_dtype=torch.bfloat16, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, moe_permute_fusion=False,
        init_method_std=0.02,
    )


def stock_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")


def gpt(config, spec, a, device: str, seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    m = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=a.vocab, max_sequence_length=a.seq,
                 position_embedding_type="rope")
    return m.to(device)


def lm_batch(a, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    pos = torch.arange(a.seq).unsqueeze(0).expand(a.batch, a.seq)
    mask = torch.tril(torch.ones(1, 1, a.seq, a.seq, dtype=torch.bool)).logical_not()
    return [t.to(device) for t in (tokens, pos, mask, torch.roll(tokens, -1, 1))]


def perturb_non_experts(model, scale: float, seed: int = 1) -> None:
    """Relative noise on the non-expert parameters: a rollout engine with slightly different numerics."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." not in name:
                noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
                p.add_((noise * scale * p.float().abs().mean()).to(p.dtype))
