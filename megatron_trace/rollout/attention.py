"""The hf rollout's attention: SDPA, except a decode step over a deferred FP4 KV history, which runs the
fused FP4-KV decode attention (``kernels.kv_attention``: K/V dequantized in registers, never written in bf16), and a
static decode step over a static cache's unquantized layer, which runs the dense decode attention (one read of each
KV head's rows, each row's interval only; SDPA would take its masked path over every buffer row).

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

from ..formats.tensor import FP4Tensor
from ..kernels.kv_attention import dense_decode_attention, fp4kv_decode_attention
from ..kernels.kv_intervals import mask_intervals
from .kv_cache import DEFERRED_ATTR

ROLLOUT_ATTENTION = "megatron_trace_rollout_attention"


_LAST_MASK: list = [None, -1, -1, None, None, None]
"""The last converted mask: (SDPA mask, its version, T, (interval masks, kernel, whether a CUDA graph was being
captured), the cache's ``mask_holes`` counter, the kernel's keywords). Strong references, so the tensor (or counter)
cannot be freed and another take its identity while cached. The counter stands for the cache: another cache fed the
same mask converts again, so its own counter counts the mask's holes (its layers share it). A capture converts again
(once, at its first layer): a graph must hold the conversion's kernels, or its replays would read the intervals of
the eager call before the capture (``rollout.static_decode``)."""


def _mask_rows(attention_mask: torch.Tensor | None, t: int, layer) -> dict:
    """SDPA's 4D mask [B, 1, 1, >= T] (bool: True attends; float: 0 attends) -> the decode attention's keywords:
    ``kv_mask`` bool [B, >= T] laid out as the kernel reads it (rows of T rounded up to 4 bytes,
    ``kv_attention_plan.mask_arg``), or for a cache with ``interval_masks`` each row's ``starts`` / ``lengths``
    (``kernels.kv_intervals``; rows with a hole counted in the cache's ``mask_holes``). Converted once per decode
    step: every layer of a step gets the same mask tensor, and the layers after the first (of the same cache: same
    ``mask_holes`` counter and kernel) reuse it."""
    if attention_mask is None:
        return {}
    how = (layer.interval_masks, layer.kernel, attention_mask.is_cuda and torch.cuda.is_current_stream_capturing())
    last = _LAST_MASK
    if (last[0] is attention_mask and last[1] == attention_mask._version and last[2] == t and last[3] == how
            and last[4] is layer.mask_holes):
        return last[5]
    m = attention_mask[:, 0, -1, :t]
    m = m if m.dtype == torch.bool else m == 0
    if layer.interval_masks:
        first, end = mask_intervals(m, t, layer.mask_holes.tensor(m.device), kernel=layer.kernel)
        out = {"starts": first, "lengths": end}
    else:
        t4 = -(-t // 4) * 4
        words = torch.zeros(m.shape[0], t4, dtype=torch.bool, device=m.device)
        words[:, :t] = m
        out = {"kv_mask": words}
    last[:] = [attention_mask, attention_mask._version, t, how, layer.mask_holes, out]
    return out


@torch.compiler.disable  # eager inside compiled layers (HFRolloutBackend(compile="layers"))
def rollout_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs):
    """query [B, Hq, q, D] -> ([B, q, Hq, D], None), as transformers' attention functions."""
    layer = getattr(key, DEFERRED_ATTR, None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    k, v = layer.packed_history()  # [B, Hkv, T, D] FP4 (or dense: a static cache's unquantized layer)
    masks = _mask_rows(attention_mask, k.shape[2], layer)
    if isinstance(k, FP4Tensor):
        out = fp4kv_decode_attention(query[:, :, 0], k, v, scale=scaling, kernel=layer.kernel, kv_dtype=query.dtype,
                                     exact=not layer.fast_attention, readable_rows=layer.readable_rows(),
                                     **masks)  # [B, Hq, D]
    else:
        out = dense_decode_attention(query[:, :, 0], k, v, scale=scaling, kernel=layer.kernel,
                                     readable_rows=layer.readable_rows(), **masks)
    return out.unsqueeze(1), None


AttentionInterface.register(ROLLOUT_ATTENTION, rollout_attention_forward)
AttentionMaskInterface.register(ROLLOUT_ATTENTION, sdpa_mask)
