"""NaN / Inf put into one quantize site's input of one layer of a transformers Qwen3-MoE model (tests only).

The model's own modules are hooked (forward hooks, or the experts' gate on the instance), never this package's code:
expert_fc1_in  the experts' hidden rows (first row, element 3);
expert_fc2_in  the gated rows (``experts._apply_gate``'s output, first row, element 5);
kv_k           ``k_norm``'s output (before RoPE, which mixes element 3 with its rotation partner);
kv_v           ``v_proj``'s output.
"""

from __future__ import annotations

import torch

SITES = ("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v")
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": -float("inf")}


def inject(model, layer: int, site: str, value: float) -> None:
    """Make every forward of ``model`` put ``value`` into ``site``'s input at ``layer`` (for the model's lifetime)."""
    lay = model.model.layers[layer]
    if site == "expert_fc1_in":
        def pre(module, args):
            h = args[0].clone()
            h[0, 3:4].fill_(value)  # (fill_: no host-to-device copy, so a CUDA graph can capture it)
            return (h, *args[1:])

        lay.mlp.experts.register_forward_pre_hook(pre)
    elif site == "expert_fc2_in":
        experts = lay.mlp.experts
        gate = type(experts)._apply_gate

        def gated(h: torch.Tensor) -> torch.Tensor:
            out = gate(experts, h).clone()
            out[0, 5:6].fill_(value)
            return out

        experts._apply_gate = gated
    elif site in ("kv_k", "kv_v"):
        def post(module, args, out):
            out = out.clone()
            out.view(-1)[3:4].fill_(value)
            return out

        (lay.self_attn.k_norm if site == "kv_k" else lay.self_attn.v_proj).register_forward_hook(post)
    else:
        raise ValueError(f"site={site!r} is not one of {SITES}")
