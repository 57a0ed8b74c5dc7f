"""Transformer-Engine variants (thin): TE grouped-linear experts and TE attention with the TRACE sites.

Everything numeric is shared with the torch variant (``TraceExpertsCore``, ``TraceKVCore``): the
inputs are quantized by our code before TE's GEMM / attention, and TE fetches its weights through
``_get_weight_tensors``, which ``TraceWeightFetch`` wraps with the weight fake-quantizer. TE is an
optional extra; without it these classes raise at construction.
"""

from __future__ import annotations

import functools

from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP

from ..config import TraceConfig
from .attention import TraceKVCore
from .experts import TraceExpertsCore

TE_EXTRA_HINT = "Transformer Engine is not installed: pip install 'megatron_trace[te]'"


def require_te() -> None:
    """Raise a clear ImportError naming the extra when TE is absent."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        raise ImportError(TE_EXTRA_HINT) from e


class TraceWeightFetch:
    """Mixin for TE linear modules: the weights TE fetches are fake-quantized (STE to the parameters)."""

    trace_weight_quantizer = None

    def _get_weight_tensors(self):
        weights = super()._get_weight_tensors()
        q = self.trace_weight_quantizer
        return weights if q is None else [q.fake_quantize(w) for w in weights]


TE_MIN_VERSION = "2.5"
"""The first Transformer Engine whose GroupedLinear fetches its weights through ``_get_weight_tensors`` (older
releases read ``weight{i}`` directly, so ``TraceWeightFetch`` would never run and the weights stay BF16)."""


@functools.cache
def with_weight_fetch(base: type) -> type:
    """``base`` (a TE linear class) with ``TraceWeightFetch`` mixed in (one class per base)."""
    if not callable(getattr(base, "_get_weight_tensors", None)):
        raise ImportError(
            f"{base.__name__} has no _get_weight_tensors: its forward reads the weights directly (Transformer Engine "
            f"< {TE_MIN_VERSION}), so TRACE could not fake-quantize them; install transformer-engine>="
            f"{TE_MIN_VERSION} (pip install 'megatron_trace[te]')")
    return type(f"Trace{base.__name__}", (TraceWeightFetch, base), {"__module__": __name__})


class TraceTEGroupedMLP(TraceExpertsCore, TEGroupedMLP):
    """TE variant: parameters are TEGroupedMLP's (``linear_fc1.weight{i}``, ``linear_fc2.weight{i}``)."""

    def __init__(self, num_local_experts, config, submodules: MLPSubmodules, pg_collection=None, *,
                 trace_config: TraceConfig):
        require_te()
        if config.gradient_accumulation_fusion:
            raise ValueError(
                "TRACE TE experts need gradient_accumulation_fusion=False (--no-gradient-accumulation-fusion): "
                "TE would accumulate into the fake-quantized copies instead of the parameters"
            )
        submodules = MLPSubmodules(
            linear_fc1=with_weight_fetch(submodules.linear_fc1), linear_fc2=with_weight_fetch(submodules.linear_fc2),
            activation_func=submodules.activation_func,
        )
        TEGroupedMLP.__init__(self, num_local_experts, config, submodules, pg_collection)
        self._init_trace(trace_config, pg_collection)
        for linear in (self.linear_fc1, self.linear_fc2):
            linear.trace_weight_quantizer = self._weight_q

    def _fc1(self, x, tokens_per_expert):
        out, bias = self.linear_fc1(x, [int(c) for c in tokens_per_expert.tolist()])
        return out if bias is None else out + bias

    def _fc2(self, h, tokens_per_expert):
        out, _ = self.linear_fc2(h, [int(c) for c in tokens_per_expert.tolist()])
        return out

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        return self._trace_forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)


def trace_te_attention_class() -> type:
    """TEDotProductAttention with the KV site (defined on first use: needs TE)."""
    require_te()
    return _te_attention()


@functools.cache
def _te_attention() -> type:
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TraceTEDotProductAttention(TraceKVCore, TEDotProductAttention):
        def __init__(self, *args, trace_config: TraceConfig, **kwargs):
            TEDotProductAttention.__init__(self, *args, **kwargs)
            self._init_trace(trace_config)

        def forward(self, query, key, value, *args, **kwargs):
            # (attention_mask, attn_mask_type, attention_bias, packed_seq_params: Megatron passes the last by name)
            packed = kwargs.get("packed_seq_params", args[3] if len(args) > 3 else None)
            key = self.quantize_kv("kv_k", key, packed)
            value = self.quantize_kv("kv_v", value, packed)
            return TEDotProductAttention.forward(self, query, key, value, *args, **kwargs)

    return TraceTEDotProductAttention
