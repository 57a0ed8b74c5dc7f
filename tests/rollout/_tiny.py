"""Tiny random Qwen3-MoE models for tests (never downloaded)."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def tiny_config(**overrides) -> Qwen3MoeConfig:
    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def scale_init_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """std 1/sqrt(fan_in) weights and norms near 1, so routing and sampling are non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def tiny_model(config: Qwen3MoeConfig | None = None, seed: int = 0, dtype=torch.float32) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(config or tiny_config())
    return scale_init_(m, seed).to(dtype).eval()


def save_tiny_checkpoint(path, config: Qwen3MoeConfig | None = None, seed: int = 0) -> str:
    """Save a tiny fp32 checkpoint (safetensors, per-expert names) to ``path``; returns the path."""
    tiny_model(config, seed).save_pretrained(path)
    return str(path)
