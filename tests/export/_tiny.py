"""A tiny Qwen3-MoE-shaped set of HF-named weights (random, seeded) for export tests."""

import torch

LAYERS, EXPERTS, HIDDEN, FFN, VOCAB = 2, 3, 32, 16, 40


def tiny_named_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)  # noqa: E731
    out = [("model.embed_tokens.weight", r(VOCAB, HIDDEN))]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        out += [(f"{p}.input_layernorm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16)),
                (f"{p}.post_attention_layernorm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16)),
                (f"{p}.self_attn.q_proj.weight", r(HIDDEN, HIDDEN)),
                (f"{p}.self_attn.k_proj.weight", r(16, HIDDEN)),
                (f"{p}.self_attn.v_proj.weight", r(16, HIDDEN)),
                (f"{p}.self_attn.o_proj.weight", r(HIDDEN, HIDDEN)),
                (f"{p}.mlp.gate.weight", r(EXPERTS, HIDDEN))]
        for e in range(EXPERTS):
            q = f"{p}.mlp.experts.{e}"
            out += [(f"{q}.gate_proj.weight", r(FFN, HIDDEN)), (f"{q}.up_proj.weight", r(FFN, HIDDEN) * 3),
                    (f"{q}.down_proj.weight", r(HIDDEN, FFN))]
    out += [("model.norm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16)), ("lm_head.weight", r(VOCAB, HIDDEN))]
    return out


def tiny_hf_config() -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": HIDDEN,
            "moe_intermediate_size": FFN, "num_experts": EXPERTS, "num_experts_per_tok": 2,
            "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "torch_dtype": "bfloat16"}
