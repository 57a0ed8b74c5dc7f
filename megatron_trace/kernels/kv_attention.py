"""Decode attention over an FP4 KV cache (one query token per sequence, GQA): dispatch and torch reference.

``fp4kv_decode_attention(q, k, v)``: q [B, Hq, D]; k, v ``FP4Tensor`` [B, Hkv, T, D] (``FP4KVCache`` rows:
NVFP4 with a per-row or per-tensor global amax, or MXFP4); ``lengths`` int [B] (None: all T) masks each
sequence's tail, ``starts`` int [B] (None: 0) its head (left padding: the Triton path does not read the tiles
before it), ``kv_mask`` bool [B, >= T] (False: not attended; e.g. left padding) any position.
The reference dequantizes K/V to bf16 (``FP4Tensor.dequantize``) and runs softmax attention in fp32. The
Triton path (CUDA) decodes K/V inside the kernel and accumulates in fp32 with bf16 MMAs; ``exact`` picks how:
``exact=True`` (default) the same bf16 K/V values as the reference and the trainer's fake-quantized K/V;
``exact=False``: the fast kernel (~6x the exact one at long context on the H200: BENCHMARKS.md), K/V as their
exact FP4 values (code x block scale, exact in bf16,
with 1/S_enc applied per row to the scores and softmax weights): equal to ``reference_attention(...,
kv_dtype=torch.float32)`` within bf16 rounding of the softmax weights; it differs from the bf16 reference by that
reference's K/V rounding (2**-9 relative), which large scores (|q.k| * scale >> 1) amplify.
``exact=True`` costs an fp32 division per element (~8x the fast kernel's instructions) and equals the reference
within bf16 rounding, not bit for bit. The hf rollout runs the fast kernel by default
(``HFRolloutBackend(fast_kv_attention=True)``): its K/V differ from the trainer's bf16 K/V, which moved a 12-layer
random-weight model's logits by 0.14 relative (H200, 2026-12-01), but the RL demo's train-rollout mismatch with it
was within seed noise of the exact kernel's over 3 seeds (BENCHMARKS.md, session 5).

``dense_decode_attention(q, k, v)``: the same over K/V in the model dtype (a static cache's unquantized layers,
``rollout.static_decode``): fp32 reference, Triton twin ``kv_attention_dense_triton``.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..formats.tensor import FP4Tensor
from .dispatch import Kernel, select_kernel

ROW_ALIGN = 16
"""The loads' row bound is rounded up to this where the caller's ``readable_rows`` allow: Triton's JIT specializes
an integer argument divisible by 16, so every load mask is uniform over 16 rows. H200, fast kernel, 16 / 4 heads
of 128 (``bench_decode_attn.py``, session 12): 451 / 124 us at b64 and T = 32768 / 8192, 516 / 142 us at
T = 32769 / 8193."""


def aligned_rows(t_len: int, readable_rows: int | None) -> int:
    """The K/V rows the loads may cover: T rounded up to ``ROW_ALIGN`` if within ``readable_rows``, else T."""
    if readable_rows is None:
        return t_len
    if isinstance(readable_rows, bool) or not isinstance(readable_rows, numbers.Integral):  # (17.5 bounded the loads)
        raise ValueError(f"readable_rows={readable_rows!r} must be an int >= the K/V length T={t_len}, or None")
    if readable_rows < t_len:
        raise ValueError(f"readable_rows={readable_rows} must be >= the K/V length T={t_len}")
    up = -(-t_len // ROW_ALIGN) * ROW_ALIGN
    return up if up <= readable_rows else t_len


def check_args(q: torch.Tensor, k: FP4Tensor, v: FP4Tensor, lengths, kv_mask=None, starts=None) -> None:
    if not (isinstance(k, FP4Tensor) and isinstance(v, FP4Tensor)):
        raise TypeError(f"k and v must be FP4Tensor, got {type(k).__name__}, {type(v).__name__}")
    if (k.fmt, k.block_size) != (v.fmt, v.block_size):
        raise ValueError(f"k ({k.fmt}) and v ({v.fmt}) must share one FP4 format: the kernel decodes both alike")
    _check_layout(q, tuple(k.shape), tuple(v.shape), lengths, kv_mask, starts)
    d = q.shape[-1]
    if d % k.block_size:
        raise ValueError(f"head_dim={d} must be a multiple of the {k.fmt} block {k.block_size}")


def softmax_scale(scale, d: int) -> float:
    """The scores' scale: ``scale``, or ``d ** -0.5`` where None; refused unless a finite real > 0 (not a bool: True
    was taken as 1.0; NaN / Inf made every output NaN, 0 or less attended uniformly or the least similar rows)."""
    if scale is None:
        return d**-0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (0 < scale < math.inf):
        raise ValueError(f"scale={scale!r} must be a finite real > 0 (the scores' softmax scale), or None for "
                         f"head_dim ** -0.5 = {d**-0.5:.6g}")
    return float(scale)


def _check_layout(q: torch.Tensor, k_shape: tuple, v_shape: tuple, lengths, kv_mask, starts) -> None:
    if not isinstance(q, torch.Tensor) or not q.dtype.is_floating_point:  # (an int q: an int result, truncated)
        raise TypeError(f"q must be a floating-point tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if q.dim() != 3 or len(k_shape) != 4 or k_shape != v_shape:
        raise ValueError(f"q must be [B, Hq, D] and k, v [B, Hkv, T, D] alike; got q {tuple(q.shape)}, "
                         f"k {k_shape}, v {v_shape}")
    b, hq, d = q.shape
    kb, hkv, t, kd = k_shape
    if kb != b or kd != d or hkv < 1 or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {k_shape}: same B and D, Hq a multiple of Hkv")
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim={d} must be a power of two")
    for name, rows in (("lengths", lengths), ("starts", starts)):
        if rows is not None and not isinstance(rows, torch.Tensor):
            raise TypeError(f"{name} must be an integer tensor [B={b}] or None, got {type(rows).__name__}")
        if rows is not None and tuple(rows.shape) != (b,):
            raise ValueError(f"{name} must be [B={b}], got {tuple(rows.shape)}")
        if rows is not None and (rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool):
            # (a float length 4.5 attends 5 rows in the reference, 4 in the kernels: their int32 cast)
            raise ValueError(f"{name} must be an integer tensor, got {rows.dtype}")
    if kv_mask is not None and not isinstance(kv_mask, torch.Tensor):
        raise TypeError(f"kv_mask must be a bool or uint8 tensor [B={b}, >= T={t}] or None, got "
                        f"{type(kv_mask).__name__}")
    if kv_mask is not None and (kv_mask.dim() != 2 or kv_mask.shape[0] != b or kv_mask.shape[1] < t):
        raise ValueError(f"kv_mask must be [B={b}, >= T={t}], got {tuple(kv_mask.shape)}")
    if kv_mask is not None and kv_mask.dtype not in (torch.bool, torch.uint8):  # (an additive float mask: 0 attends)
        raise ValueError(f"kv_mask must be bool or uint8 (non-zero: attended), got {kv_mask.dtype}")


def reference_attention(q, k: FP4Tensor, v: FP4Tensor, *, scale: float | None = None, lengths=None,
                        kv_mask=None, kv_dtype: torch.dtype = torch.bfloat16, starts=None) -> torch.Tensor:
    """Softmax attention (fp32) over K/V dequantized to ``kv_dtype``; [B, Hq, D] in q.dtype."""
    check_args(q, k, v, lengths, kv_mask, starts)
    return _softmax_attention(q, k.dequantize(kv_dtype), v.dequantize(kv_dtype), scale, lengths, kv_mask, starts)


def _softmax_attention(q, k: torch.Tensor, v: torch.Tensor, scale, lengths, kv_mask, starts) -> torch.Tensor:
    """fp32 softmax attention of q [B, Hq, D] over dense k, v [B, Hkv, T, D], masked; [B, Hq, D] in q.dtype."""
    hq, d = q.shape[1:]
    hkv, t = k.shape[1], k.shape[2]
    scale = softmax_scale(scale, d)
    kd = k.float().repeat_interleave(hq // hkv, 1)  # [B, Hq, T, D]
    vd = v.float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("bhd,bhtd->bht", q.float(), kd) * scale
    if lengths is not None:
        s = s.masked_fill(torch.arange(t, device=s.device)[None, None, :] >= lengths.to(s.device)[:, None, None],
                          float("-inf"))
    if starts is not None:
        s = s.masked_fill(torch.arange(t, device=s.device)[None, None, :] < starts.to(s.device)[:, None, None],
                          float("-inf"))
    if kv_mask is not None:
        s = s.masked_fill(~kv_mask[:, :t].to(device=s.device, dtype=torch.bool)[:, None, :], float("-inf"))
    return torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), vd).to(q.dtype)


def fp4kv_decode_attention(q, k: FP4Tensor, v: FP4Tensor, *, scale: float | None = None, lengths=None,
                           starts=None, kv_mask=None, kernel: str | Kernel = "auto",
                           kv_dtype: torch.dtype = torch.bfloat16, exact: bool = True,
                           readable_rows: int | None = None) -> torch.Tensor:
    """Decode attention reading the FP4 KV cache directly (see the module docstring); [B, Hq, D] in q.dtype.

    ``kv_dtype``: the reference's dequantized K/V dtype. ``exact``: the Triton path's kernel (see above).
    ``readable_rows``: K/V rows [0, R >= T) that the Triton path may read, finite (see
    ``kv_attention_triton.decode_attention``); the result does not depend on it."""
    if not isinstance(exact, bool):  # ("no" is truthy: the exact kernel)
        raise ValueError(f"exact={exact!r} must be a bool")
    aligned_rows(k.shape[2], readable_rows)  # (checked on every path: the reference ignores it)
    if select_kernel(kernel, k.codes.device) is Kernel.REFERENCE:
        return reference_attention(q, k, v, scale=scale, lengths=lengths, kv_mask=kv_mask, kv_dtype=kv_dtype,
                                   starts=starts)
    check_args(q, k, v, lengths, kv_mask, starts)
    scale = softmax_scale(scale, q.shape[-1])
    if k.shape[2] == 0:  # no history: the reference's (empty) weighted sum
        return torch.zeros_like(q)
    from . import kv_attention_triton

    return kv_attention_triton.decode_attention(q, k, v, scale=scale, lengths=lengths, starts=starts,
                                                kv_mask=kv_mask, readable_rows=readable_rows, exact=exact)


def check_dense_args(q, k: torch.Tensor, v: torch.Tensor, lengths, kv_mask=None, starts=None) -> None:
    """``check_args`` for K/V in the model dtype: tensors [B, Hkv, T, D] of q's dtype and device."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise TypeError(f"k and v must be dense tensors, got {type(k).__name__}, {type(v).__name__}")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(f"k, v must have q's dtype and device ({q.dtype}, {q.device}); got k {k.dtype} on "
                         f"{k.device}, v {v.dtype} on {v.device}")
    _check_layout(q, tuple(k.shape), tuple(v.shape), lengths, kv_mask, starts)


def dense_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                           lengths=None, starts=None, kv_mask=None, kernel: str | Kernel = "auto",
                           readable_rows: int | None = None) -> torch.Tensor:
    """Decode attention over K/V in the model dtype (a static cache's plain rows): arguments and result as
    ``fp4kv_decode_attention``. The reference: fp32 softmax attention; the Triton path
    (``kv_attention_dense_triton``, CUDA) equals it within bf16 rounding of the softmax weights."""
    check_dense_args(q, k, v, lengths, kv_mask, starts)
    aligned_rows(k.shape[2], readable_rows)  # (checked on every path: the reference ignores it)
    if select_kernel(kernel, k.device) is Kernel.REFERENCE:
        return _softmax_attention(q, k, v, scale, lengths, kv_mask, starts)
    scale = softmax_scale(scale, q.shape[-1])
    if k.shape[2] == 0:  # no history: the reference's (empty) weighted sum
        return torch.zeros_like(q)
    from . import kv_attention_dense_triton

    return kv_attention_dense_triton.decode_attention(q, k, v, scale=scale, lengths=lengths, starts=starts,
                                                      kv_mask=kv_mask, readable_rows=readable_rows)
