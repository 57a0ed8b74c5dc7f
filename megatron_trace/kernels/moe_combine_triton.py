"""The MoE experts' weighted combine in one Triton launch: ``out[t] = sum_j w[t, j] * y[inv[t * k + j]]``.

``rollout.fp4_moe``'s eager combine is three PyTorch launches over [T, k, H] tensors: the gather ``y[inv]``, the
multiply by the router weights, the sum over the k slots, each writing its [T, k, H] result (about 0.9 ms per
layer at 16K prompt tokens on the H200, 12% of a prefill: BENCHMARKS.md, session 29). This kernel reads each
expert output row once and writes [T, H].

Numerics, as the eager code: each product ``y * w`` rounded to y's dtype (the weights cast to it first), the k
products summed in fp32 and rounded once to ``dtype``. The fp32 sum's order is ``ORDER``: "vt4" keeps four
partial sums, slot j going to partial j % 4, then adds them left to right (how PyTorch's CUDA reduction
accumulates a short reduced dimension in one thread); "seq" adds the slots left to right. ``combine_reference``
is the torch spec of both; the kernel equals it bit for bit. "vt4" gave the PyTorch ops' bits on the H200 at k = 8
(a sum that only that order keeps exact, and random rows up to 16384 x 2048) and k = 6 (random rows); "seq" differed
(tests/gpu/test_moe_combine_gpu.py, benchmarks/bench_moe_combine.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fp4 as f
from .dispatch import cdiv

ORDERS = ("vt4", "seq")
ORDER = "vt4"
"""The fp32 sum order the rollout uses (see the module docstring)."""
BLOCK_H = 1024
NUM_WARPS = 4


@triton.jit
def _product(y_ptr, inv_ptr, w_ptr, t, j, h, hmask, K: tl.constexpr, stride_y, stride_wt, stride_wk):
    """fp32 of (y[inv[t k + j], h] * w[t, j]) rounded to y's dtype, w cast to it first."""
    row = tl.load(inv_ptr + t * K + j)
    y = tl.load(y_ptr + row * stride_y + h, mask=hmask, other=0.0)
    w = f.to_dtype(tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32), y.dtype)
    return f.to_dtype(y.to(tl.float32) * w.to(tl.float32), y.dtype).to(tl.float32)  # (RNE by bits for bf16)


@triton.jit
def combine_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, H, stride_y, stride_wt, stride_wk, stride_o,
                   K: tl.constexpr, BH: tl.constexpr, VT4: tl.constexpr):
    """Program (token t, column block): out[t, h] for BH columns h."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = h < H
    a0 = tl.zeros([BH], tl.float32)
    a1 = tl.zeros([BH], tl.float32)
    a2 = tl.zeros([BH], tl.float32)
    a3 = tl.zeros([BH], tl.float32)
    for j in tl.static_range(K):
        p = _product(y_ptr, inv_ptr, w_ptr, t, j, h, hmask, K, stride_y, stride_wt, stride_wk)
        if not VT4 or j % 4 == 0:
            a0 += p
        elif j % 4 == 1:
            a1 += p
        elif j % 4 == 2:
            a2 += p
        else:
            a3 += p
    acc = ((a0 + a1) + a2) + a3
    tl.store(out_ptr + t * stride_o + h, f.to_dtype(acc, out_ptr.dtype.element_ty), mask=hmask)


def combine_reference(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                      order: str = ORDER) -> torch.Tensor:
    """The torch spec: y [T*k, H] expert outputs, inv int [T*k] the row of (token, slot) t*k + j, weights [T, k]
    -> [T, H] in ``dtype`` (see the module docstring for the rounding and ``order``)."""
    _check(y, inv, weights, order)
    tokens, k = weights.shape
    prod = (y[inv].view(tokens, k, y.shape[-1]) * weights.unsqueeze(-1).to(y.dtype)).float()
    parts = [torch.zeros_like(prod[:, 0]) for _ in range(4 if order == "vt4" else 1)]
    for j in range(k):
        parts[j % len(parts)] = parts[j % len(parts)] + prod[:, j]
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.to(dtype)


def combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
            order: str = ORDER) -> torch.Tensor:
    """``combine_reference`` in one launch (CUDA, or Triton's CPU interpreter); no host sync. ``inv`` must be a
    permutation of [0, T*k) (the routing's): its values are not checked, as that would sync."""
    _check(y, inv, weights, order)
    tokens, k = weights.shape
    h = y.shape[1]
    if y.stride(1) != 1:
        y = y.contiguous()
    out = torch.empty(tokens, h, dtype=dtype, device=y.device)
    if tokens:
        combine_kernel[(tokens, cdiv(h, BLOCK_H))](
            y, inv.contiguous(), weights, out, h, y.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
            K=k, BH=BLOCK_H, VT4=order == "vt4", num_warps=NUM_WARPS)
    return out


def _check(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not one of {ORDERS}")
    if (y.dim() != 2 or weights.dim() != 2 or inv.dim() != 1
            or not inv.numel() == weights.numel() == y.shape[0]):
        raise ValueError(f"combine needs y [T*k, H], inv [T*k] and weights [T, k]; got y {tuple(y.shape)}, "
                         f"inv {tuple(inv.shape)}, weights {tuple(weights.shape)}")
