"""Decode attention over K/V in the model dtype (``kernels.kv_attention.dense_decode_attention``, a static cache's
unquantized layers): the fp32 reference against SDPA, its masks, and the Triton kernel against the reference on small
shapes (CUDA, or Triton's CPU interpreter: fp32 dots). The GPU shapes: tests/gpu/test_kv_attention_gpu.py."""

import pytest
import torch
import torch.nn.functional as F

from megatron_trace.kernels.kv_attention import dense_decode_attention

from ._gpu import DEVICE, needs_triton


def _case(seed, b=3, hq=8, hkv=2, t=37, d=32, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, *rest, generator=g) for h, rest in ((hq, (d,)), (hkv, (t, d)), (hkv, (t, d))))
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _sdpa(q, k, v, keep):
    """SDPA per row of the kept positions (``keep`` bool [B, T]): the independent computation."""
    g = q.shape[1] // k.shape[1]
    out = []
    for i in range(q.shape[0]):
        ki, vi = (x[i : i + 1, :, keep[i]].float().repeat_interleave(g, 1) for x in (k, v))
        out.append(F.scaled_dot_product_attention(q[i : i + 1, :, None].float(), ki, vi)[:, :, 0])
    return torch.cat(out)


def test_reference_is_sdpa_over_each_rows_attended_positions():
    q, k, v = _case(0)
    lengths, starts = torch.tensor([37, 20, 9]), torch.tensor([0, 3, 8])
    mask = torch.ones(3, 37, dtype=torch.bool)
    mask[0, 5:9] = False
    keep = mask & (torch.arange(37) < lengths[:, None]) & (torch.arange(37) >= starts[:, None])
    got = dense_decode_attention(q, k, v, lengths=lengths, starts=starts, kv_mask=mask)
    assert torch.allclose(got, _sdpa(q, k, v, keep), atol=1e-5)


@pytest.mark.parametrize("bad,match", [("fp16", "q's dtype"), ("hq", "multiple of Hkv"), ("len", "lengths"),
                                       ("shape", "alike"), ("mask", "kv_mask must be bool or uint8")])
def test_bad_arguments_are_named(bad, match):
    q, k, v = _case(1)
    lengths = torch.tensor([1, 2]) if bad == "len" else None
    mask = torch.where(torch.arange(37) < 4, float("-inf"), 0.0).expand(3, 37) if bad == "mask" else None
    if bad == "fp16":
        k = k.half()
    elif bad == "hq":
        q = q[:, :7]
    elif bad == "shape":
        v = v[:, :, :5]
    with pytest.raises((ValueError, TypeError), match=match):
        dense_decode_attention(q, k, v, lengths=lengths, kv_mask=mask)


@needs_triton
@pytest.mark.parametrize("t, block_t, splits, intervals", [(37, 16, 1, False), (37, 16, 3, True), (64, 32, 2, True),
                                                           (100, 16, 4, False)])
def test_kernel_matches_the_reference(t, block_t, splits, intervals):
    """Left padding, finished tails and a hole (mask) or intervals (starts / lengths), split along T; readable rows
    past T (zeros) change nothing, and the rows past them (NaN) are not read; q a strided view. Equal within bf16
    rounding of the softmax weights (fp32 under the interpreter)."""
    from megatron_trace.kernels import kv_attention_dense_triton as dense

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q, k, v = _case(2, t=t, dtype=dtype, device=DEVICE)
    q = torch.stack([q, torch.full_like(q, float("nan"))], -1)[..., 0]  # a view with q.stride(-1) == 2 (copied)
    rows = -(-t // 16) * 16
    k, v = (torch.cat([x, x.new_zeros(*x.shape[:2], rows - t, x.shape[3]),  # spare zero rows, then unreadable NaN
                       x.new_full((*x.shape[:2], 16, x.shape[3]), float("nan"))], 2) for x in (k, v))
    starts = torch.tensor([0, 4, 9], device=DEVICE)
    lengths = torch.tensor([t, t - 3, 11], device=DEVICE)
    masks = {"starts": starts, "lengths": lengths} if intervals else {
        "kv_mask": (torch.arange(rows, device=DEVICE) >= starts[:, None]) & (torch.arange(rows, device=DEVICE)
                                                                           < lengths[:, None])}
    if not intervals:
        masks["kv_mask"][1, 6:8] = False
    kk, vv = k[:, :, :t], v[:, :, :t]
    want = dense_decode_attention(q, kk, vv, kernel="reference", **{n: m[:, :t] if n == "kv_mask" else m
                                                                    for n, m in masks.items()})
    got = dense.decode_attention(q, kk, vv, scale=q.shape[-1] ** -0.5, block_t=block_t, splits=splits,
                                 readable_rows=rows, **masks)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == q.dtype
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    auto = dense_decode_attention(q, kk, vv, **masks)  # auto: the kernel on CUDA, the reference on the CPU
    assert torch.allclose(auto.float(), want.float(), atol=tol, rtol=tol)
