"""``rollout.attention`` on a deferred FP4 cache step: the fused decode attention equals SDPA over the dequantized
history under the same mask, whether SDPA's mask is bool or float, as wide as the history or wider (a static
buffer's), with the caller's scale; each new mask tensor is converted anew."""

import torch
import torch.nn.functional as F

from megatron_trace.config import TraceConfig
from megatron_trace.rollout.attention import rollout_attention_forward
from megatron_trace.rollout.kv_cache import FP4KVCache

B, HQ, HKV, T, D = 2, 4, 2, 7, 32


def _step(interval_masks: bool):
    g = torch.Generator().manual_seed(3)
    cache = FP4KVCache(1, TraceConfig().activation_quantizer(), fused_decode=True, interval_masks=interval_masks)
    k, v = torch.randn(B, HKV, T - 1, D, generator=g), torch.randn(B, HKV, T - 1, D, generator=g)
    cache.update(k, v, 0)
    k1, v1 = torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g)
    key, value = cache.update(k1, v1, 0)  # deferred: the new key with its layer attached
    hk, hv = cache.layers[0].packed_history()
    return key, value, hk.dequantize(), hv.dequantize(), torch.randn(B, HQ, 1, D, generator=g)


def _reference(q, hk, hv, attend, scale):
    hk, hv = hk.repeat_interleave(HQ // HKV, 1), hv.repeat_interleave(HQ // HKV, 1)
    return F.scaled_dot_product_attention(q, hk, hv, attn_mask=attend[:, None, None, :], scale=scale).transpose(1, 2)


def test_fused_decode_equals_sdpa_over_the_history_for_each_mask_form():
    attend = torch.ones(B, T, dtype=torch.bool)
    attend[1, :3] = False  # row 1 left-padded
    for interval_masks in (False, True):
        key, value, hk, hv, q = _step(interval_masks)
        want = _reference(q, hk, hv, attend, 0.3)
        wider = torch.cat([attend, torch.tensor([[False, True, True], [True, False, True]])], 1)  # past T: unread
        floats = torch.zeros(B, 1, 1, T).masked_fill(~attend[:, None, None, :], torch.finfo(torch.float32).min)
        for mask in (attend[:, None, None, :], wider[:, None, None, :], floats):
            got, _ = rollout_attention_forward(None, q, key, value, mask.clone(), scaling=0.3)
            assert got.shape == (B, 1, HQ, D)
            assert torch.allclose(got, want, atol=1e-5), (interval_masks, mask.dtype, mask.shape)
        # another mask tensor of the same shape and version: its own rows, not the last one's
        other = torch.stack([attend[0] & (torch.arange(T) >= 2), attend[1]])
        got, _ = rollout_attention_forward(None, q, key, value, other[:, None, None, :], scaling=0.3)
        assert torch.allclose(got, _reference(q, hk, hv, other, 0.3), atol=1e-5), interval_masks
