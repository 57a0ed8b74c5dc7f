"""Real guidance test data: random activations quantized by the reference formats (no mocks)."""

from __future__ import annotations

import torch

from megatron_trace.formats import mxfp4, nvfp4
from megatron_trace.guidance.records import SampleGuidance, split_batch
from megatron_trace.guidance.serial import plan_flat, sample_to_tensors
from megatron_trace.guidance.site import SiteGuidance

# Small dims with K not a multiple of the block (padding exercised): hidden 40, ffn 24, head_dim 20.
DIMS = dict(hidden=40, ffn=24, topk=3, kv_heads=2, head_dim=20, experts=8)
SITES = ("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v")


def rows_shape(site: str, B: int, S: int) -> tuple[int, ...]:
    d = DIMS
    return {
        "expert_fc1_in": (B, S, d["hidden"]),
        "expert_fc2_in": (B, S, d["topk"], d["ffn"]),
        "kv_k": (B, S, d["kv_heads"], d["head_dim"]),
        "kv_v": (B, S, d["kv_heads"], d["head_dim"]),
    }[site]


def quantize(x: torch.Tensor, fmt: str):
    return nvfp4.quantize(x, per_row=True) if fmt == "nvfp4" else mxfp4.quantize(x)


def make_batch(
    B=3, S=9, *, layers=(0, 2), sites=SITES, fmt="nvfp4", compact=True, seed=0, lengths=None, left_pad=False
):
    """(batch guidance, rollout activations, token_ids [B,S], attention mask [B,S])."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [S - (b % 3) for b in range(B)]
    pos = torch.arange(S)[None, :]
    L = torch.tensor(lengths)[:, None]
    mask = pos >= (S - L) if left_pad else pos < L  # [B, S]
    token_ids = torch.randint(0, 50_000, (B, S), generator=g) * mask  # padding id 0
    batch, acts = {}, {}
    for layer in layers:
        for site in sites:
            x = torch.randn(rows_shape(site, B, S), generator=g) * (1 + 3 * torch.rand(1, generator=g))
            q = quantize(x, fmt)
            ids = None
            valid = mask.clone()
            if site == "expert_fc2_in":
                ids = torch.randint(0, DIMS["experts"], (B, S, DIMS["topk"]), generator=g)
                valid = mask[..., None].expand(B, S, DIMS["topk"]).clone()
            batch[(layer, site)] = SiteGuidance(q.guidance(compact), valid, ids)
            acts[(layer, site)] = x
    return batch, acts, token_ids, mask


def assert_samples_equal(a: SampleGuidance, b: SampleGuidance) -> None:
    """Bit-exact equality of two samples (all tensors compared as bytes)."""
    ta, ma = sample_to_tensors(a)
    tb, mb = sample_to_tensors(b)
    assert ma == mb
    assert ta.keys() == tb.keys()
    for k in ta:
        x, y = ta[k].contiguous(), tb[k].contiguous()
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.reshape(-1).view(torch.uint8).cpu(), y.reshape(-1).view(torch.uint8).cpu()), k
    for key in a.sites:
        assert type(a.sites[key].record) is type(b.sites[key].record)
        assert a.sites[key].record.block_scales.dtype == b.sites[key].record.block_scales.dtype


def step_samples(step, B=4, **kw) -> list[SampleGuidance]:
    """``B`` split samples of a ``make_batch`` seeded by ``step``: version ``step``, ids ``100 * step + i``."""
    batch, _, tok, mask = make_batch(B=B, seed=step, **kw)
    return split_batch(batch, tok, version=step, attention_mask=mask, sample_ids=[100 * step + i for i in range(B)])


def flat_size(samples) -> int:
    """The bytes ``samples`` take in a flat host buffer (``serial.plan_flat``)."""
    return plan_flat(samples).total
