"""The transformers model behind the hf rollout: loading it, its fused routed experts, and the checks of an FP4
rollout's expert-weight updates (``HFRolloutBackend.update_weights``)."""

from __future__ import annotations

import copy
import os

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ..formats import FP4Tensor
from ..manifest import experts_name
from .experts import EXPERTS_IMPLEMENTATION, FC1, FC2
from .hf_weights import FUSED_EXPERTS, join_fc1, parse_expert_name


def load_model(source, dtype, device, attn_implementation: str) -> PreTrainedModel:
    """A checkpoint directory, a ``Qwen3MoeConfig`` (random init) or a loaded model, on ``device`` in ``dtype``."""
    if isinstance(source, PreTrainedModel):
        return source.to(device=device, dtype=dtype)
    if isinstance(source, Qwen3MoeConfig):
        model = Qwen3MoeForCausalLM(copy.deepcopy(source))
        model.set_attn_implementation(attn_implementation)
        return model.to(device=device, dtype=dtype)
    if isinstance(source, str | os.PathLike):
        path = os.path.expanduser(os.fspath(source))
        local = isinstance(source, os.PathLike) or os.path.isabs(path) or path.startswith(("./", "../", "~"))
        if (local or os.path.exists(path)) and not os.path.isdir(path):  # (a missing path: "Repo id must be ...")
            raise NotADirectoryError(f"model={os.fspath(source)!r} must be a checkpoint directory; it "
                                     f"{'is a file' if os.path.exists(path) else 'does not exist'}")
        return AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation, experts_implementation=EXPERTS_IMPLEMENTATION
        ).to(device)
    raise TypeError(f"model must be a checkpoint dir, a Qwen3MoeConfig or a PreTrainedModel, "
                    f"got {type(source).__name__}")


def routed_experts(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """Layer id -> fused experts module (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F])."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} is not a decoder-only causal LM with model.layers")
    experts = {i: layer.mlp.experts for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")}
    bad = [i for i, m in experts.items() if not (hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"))]
    if not experts or bad:
        raise TypeError(f"{type(model).__name__}: the hf backend needs Qwen3-MoE style fused routed experts "
                        f"(gate_up_proj, down_proj) in its MoE layers")
    return experts


def checked_fp4_updates(store, experts: dict, fp4: dict) -> list[tuple[int, int, str, FP4Tensor]]:
    """(layer, expert, "fc1" | "fc2", value) of every FP4 update ``fp4`` {(layer, expert): {proj: FP4Tensor}} (gate
    and up joined), each checked as ``store.set`` (an ``experts.ExpertWeightStore``) will."""
    out = []
    for (layer, e), parts in fp4.items():
        if "gate_proj" in parts:
            out.append((layer, e, FC1, join_fc1(parts["gate_proj"], parts["up_proj"])))
        if "down_proj" in parts:
            out.append((layer, e, FC2, parts["down_proj"]))
    for layer, e, which, q in out:
        store.check(experts[layer], layer, e, which, q)
    return out


def check_fc1_pairs(halves: dict, fp4: dict) -> set[tuple[int, int, str]]:
    """An FP4 rollout's fc1 updates come as gate_proj and up_proj together (one quantized matrix), in BF16
    (``halves`` {(layer, expert, "fc1" | "fc2"): projs}) and in FP4 alike; returns the BF16-updated matrices."""
    for (layer, e, which), got in halves.items():
        if which == FC1 and got != {"gate_proj", "up_proj"}:
            raise ValueError(f"layer {layer} expert {e}: FP4 mode needs gate_proj and up_proj together "
                             f"(one quantized fc1 matrix), got only {sorted(got)}")
    for (layer, e), parts in fp4.items():
        if ("gate_proj" in parts) != ("up_proj" in parts):
            raise ValueError(f"layer {layer} expert {e}: FP4 fc1 needs gate_proj and up_proj together")
    return set(halves)


def sort_updates(weights, state: dict, experts: dict, store, bf16_layers) -> tuple[list, dict, dict]:
    """An update's HF-named ``weights`` sorted for the model: (dense (target tensor, value, name) copies, BF16 expert
    halves per (layer, expert, FC1/FC2), FP4 expert values per (layer, expert)); refuses names the model does not
    have, fused expert names where experts are FP4 (``store`` set), and FP4 values where they cannot be used."""
    dense, halves, fp4 = [], {}, {}
    for name, value in weights:
        parsed = parse_expert_name(name)
        fused = FUSED_EXPERTS.match(name)
        if fused and store is not None and int(fused.group(1)) not in bf16_layers:
            raise ValueError(f"{name!r}: FP4 experts are updated per expert (they are re-quantized from those "
                             "names): send hf_weights.checkpoint_tensors(model)'s names, "
                             "'model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight'")
        if parsed is None:
            if isinstance(value, FP4Tensor):
                raise ValueError(f"{name!r}: FP4 weights are accepted for routed experts only")
            if name not in state:
                raise KeyError(f"{name!r} is not a weight of this model (expected HF checkpoint names, "
                               f"e.g. 'model.embed_tokens.weight')")
            dense.append((state[name], value, name))
            continue
        layer, e, proj = parsed
        m = _expert_slot(experts, name, layer, e)
        ffn = m.down_proj.shape[-1]
        if isinstance(value, FP4Tensor) and layer in bf16_layers:
            raise ValueError(f"{name!r}: TraceConfig.exclude_modules keeps {experts_name(layer)!r} in BF16; "
                             "send its BF16 weights")
        if isinstance(value, FP4Tensor):
            if store is None:
                raise ValueError(f"{name!r}: FP4 weights need mode='fp4' with the 'weights' site")
            fp4.setdefault((layer, e), {})[proj] = value
            continue
        target = m.down_proj[e] if proj == "down_proj" else m.gate_up_proj[e, :ffn] if proj == "gate_proj" \
            else m.gate_up_proj[e, ffn:]
        dense.append((target, value, name))
        if layer not in bf16_layers:  # excluded experts are used as they come
            halves.setdefault((layer, e, FC2 if proj == "down_proj" else FC1), set()).add(proj)
    return dense, halves, fp4


def _expert_slot(experts: dict, name: str, layer: int, expert: int) -> torch.nn.Module:
    m = experts.get(layer)
    if m is None or not 0 <= expert < m.num_experts:
        n = next(iter(experts.values())).num_experts if experts else 0
        raise KeyError(f"{name!r}: layer {layer} has no routed expert {expert} "
                       f"(MoE layers {sorted(experts)}, experts 0..{n - 1})")
    return m
