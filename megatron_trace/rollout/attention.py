"""The hf rollout's attention: SDPA, except a decode step over a deferred FP4 KV history, which runs the
fused FP4-KV decode attention (``kernels.kv_attention``: K/V dequantized in registers, never written in bf16).

Registered with transformers' ``AttentionInterface`` (and its mask interface, with SDPA's masks) under
``ROLLOUT_ATTENTION``; ``HFRolloutBackend`` selects it in place of "sdpa". A deferred update
(``FP4KVCache(fused_decode=True)``) returns the new key with its cache layer attached
(``kv_cache.DEFERRED_ATTR``); any other call (prefill, BF16 caches, ``fused_decode`` off) is transformers'
SDPA attention unchanged.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from ..kernels.kv_attention import fp4kv_decode_attention
from .kv_cache import DEFERRED_ATTR

ROLLOUT_ATTENTION = "megatron_trace_rollout_attention"


def _kv_mask(attention_mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """SDPA's 4D mask [B, 1, 1, >= T] (bool: True attends; float: 0 attends) -> bool [B, T], or None."""
    if attention_mask is None:
        return None
    m = attention_mask[:, 0, -1, :t]
    return m if m.dtype == torch.bool else m == 0


def rollout_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs):
    """query [B, Hq, q, D] -> ([B, q, Hq, D], None), as transformers' attention functions."""
    layer = getattr(key, DEFERRED_ATTR, None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    k, v = layer.packed_history()  # [B, Hkv, T, D] FP4
    out = fp4kv_decode_attention(query[:, :, 0], k, v, scale=scaling, kv_mask=_kv_mask(attention_mask, k.shape[2]),
                                 kernel=layer.kernel, kv_dtype=query.dtype,
                                 exact=not layer.fast_attention)  # [B, Hq, D]
    return out.unsqueeze(1), None


AttentionInterface.register(ROLLOUT_ATTENTION, rollout_attention_forward)
AttentionMaskInterface.register(ROLLOUT_ATTENTION, sdpa_mask)
