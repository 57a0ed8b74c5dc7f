"""A tiny Qwen3-MoE-shaped set of HF-named weights (random, seeded) for export tests."""

from collections.abc import Iterator

import torch

LAYERS, EXPERTS, HIDDEN, FFN, VOCAB = 2, 3, 32, 16, 40


def tiny_named_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    return list(named_weights(seed))


def named_weights(seed: int = 0, *, layers: int = LAYERS, experts: int = EXPERTS, hidden: int = HIDDEN, ffn: int = FFN,
                  vocab: int = VOCAB) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights one at a time, made as they are asked for (a stream, as the bridge's export yields them)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)  # noqa: E731
    yield "model.embed_tokens.weight", r(vocab, hidden)
    for layer in range(layers):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)
        yield f"{p}.post_attention_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)
        yield f"{p}.self_attn.q_proj.weight", r(hidden, hidden)
        yield f"{p}.self_attn.k_proj.weight", r(16, hidden)
        yield f"{p}.self_attn.v_proj.weight", r(16, hidden)
        yield f"{p}.self_attn.o_proj.weight", r(hidden, hidden)
        yield f"{p}.mlp.gate.weight", r(experts, hidden)
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            yield f"{q}.gate_proj.weight", r(ffn, hidden)
            yield f"{q}.up_proj.weight", r(ffn, hidden) * 3
            yield f"{q}.down_proj.weight", r(hidden, ffn)
    yield "model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16)
    yield "lm_head.weight", r(vocab, hidden)


def tiny_hf_config() -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": HIDDEN,
            "moe_intermediate_size": FFN, "num_experts": EXPERTS, "num_experts_per_tok": 2,
            "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "torch_dtype": "bfloat16"}
