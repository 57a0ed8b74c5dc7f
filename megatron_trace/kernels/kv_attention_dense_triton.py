"""Triton decode attention over a K/V cache in the model dtype (bf16/fp16): the FP4 kernel's split-T loop
(``kv_attention_triton``) with plain K/V tile loads.

The static decode steps (``rollout.static_decode``) attend all rows of a fixed buffer with a mask; SDPA then takes
its masked path (K/V repeated per query head for GQA: the math or memory-efficient kernel, ~3x the FP4 step's GPU
time at batch 64 and 1K rows on the H200, session 14). This kernel reads each KV head's rows once for its ``G``
query heads, skips the tiles outside each row's interval (``starts`` / ``lengths``) and reads at most
``readable_rows`` rows, as the FP4 kernel does. Program (batch x KV head, split): for each tile of ``BT`` tokens,
``s = q K^T * scale`` (MMA in the K/V dtype, fp32 accumulation), online softmax in fp32, ``acc += p V``; splits
merge in ``kv_attention_combine``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kv_attention_plan as plan
from .dispatch import cdiv, next_pow2
from .kv_attention import aligned_rows
from .kv_attention_combine import combine_splits
from .kv_attention_loop import _dot, _online_softmax, _program, _query_rows, _store_ml, _tile_rows, _trip_count

DENSE_CONFIG = (32, 4, 3)
"""Default (BT, num_warps, num_stages), from eight configs on the H200 (``benchmarks/bench_dense_attn.py``, session
14; 16 or 32 query / 4 KV heads of 128, batch 8 / 64, 1K-32K rows): within 3% of the best config at every point
but batch 8 at 1K (12.7 vs 11.9 us); 137.7 us at batch 8 / 32K, 950.6 at batch 64 / 32K (SDPA without a mask:
146.2 / 1071.7)."""


@triton.jit
def dense_decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, first_ptr, mask_ptr, acc_ptr, ml_ptr,
    T, R, chunk, n_tiles, sm_scale,
    sq_b, sq_h, sm_b, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_FIRST: tl.constexpr, LOAD_R: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_WORDS: tl.constexpr, F32_DOT: tl.constexpr, TILES: tl.constexpr,
):
    """Partial attention of split ``program_id(1)``: acc [B, Hq, S, D] (unnormalised), ml [B, Hq, S, 2]."""
    b, h, split, start, load_end, end, first, n_tiles = _program(len_ptr, first_ptr, T, R, chunk, n_tiles, HKV, BT,
                                                                 HAS_LEN, HAS_FIRST, LOAD_R)
    q, g, gmask, d, m_i, l_i, acc = _query_rows(q_ptr, b, h, sq_b, sq_h, G, GP, D)
    q = q.to(k_ptr.dtype.element_ty)  # [GP, D]
    kp, vp = k_ptr + b * sk_b + h * sk_h, v_ptr + b * sv_b + h * sv_h
    for i in range(0, _trip_count(n_tiles, TILES)):
        t, tmask, attend = _tile_rows(mask_ptr, b, sm_b, start, load_end, end, first, i, BT, HAS_MASK, MASK_WORDS,
                                      HAS_FIRST, LOAD_R)
        k = tl.load(kp + t[:, None] * sk_t + d[None, :], mask=tmask[:, None], other=0.0)  # [BT, D]
        s = _dot(q, tl.trans(k), F32_DOT) * sm_scale  # [GP, BT]
        p, alpha, m_i, l_i = _online_softmax(s, attend, m_i, l_i)
        v = tl.load(vp + t[:, None] * sv_t + d[None, :], mask=tmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v_ptr.dtype.element_ty), v, F32_DOT)
    row = (b * (HKV * G) + h * G + g) * tl.num_programs(1) + split  # [GP] into [B, Hq, S]
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
    _store_ml(ml_ptr, row, gmask, m_i, l_i)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, lengths=None, starts=None,
                     kv_mask=None, readable_rows: int | None = None, block_t: int | None = None,
                     splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """q [B, Hq, D], k/v [B, Hkv, T, D] (q's dtype) -> [B, Hq, D]; arguments as
    ``kv_attention_triton.decode_attention`` (rows loaded but not attended must be finite: they weigh 0)."""
    bt, nw, ns = DENSE_CONFIG
    block_t, num_warps, num_stages = block_t or bt, num_warps or nw, num_stages or ns
    bsz, hq, d = q.shape
    _, hkv, t_len, _ = k.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    splits = splits or plan.exact_splits(q, bsz, hkv, t_len, block_t)
    chunk = cdiv(cdiv(t_len, splits), block_t) * block_t
    acc = torch.empty(bsz, hq, splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bsz, hq, splits, 2, dtype=torch.float32, device=q.device)
    lens = lengths.to(device=q.device, dtype=torch.int32).contiguous() if lengths is not None else ml
    firsts = starts.to(device=q.device, dtype=torch.int32).contiguous() if starts is not None else ml
    mask, words = plan.mask_arg(kv_mask, t_len, q.device) if kv_mask is not None else (ml, False)
    group = hq // hkv
    dense_decode_attn_kernel[(bsz * hkv, splits)](
        q, k, v, lens, firsts, mask, acc, ml, t_len, aligned_rows(t_len, readable_rows), chunk, chunk // block_t,
        float(scale), q.stride(0), q.stride(1), mask.stride(0), *k.stride()[:3], *v.stride()[:3],
        HKV=hkv, G=group, GP=max(16, next_pow2(group)), D=d, BT=block_t,
        HAS_LEN=lengths is not None, HAS_FIRST=starts is not None, LOAD_R=readable_rows is not None,
        HAS_MASK=kv_mask is not None, MASK_WORDS=words, F32_DOT=not q.is_cuda,
        TILES=0 if q.is_cuda else chunk // block_t, num_warps=num_warps,
        **({"num_stages": num_stages} if q.is_cuda else {}))
    return combine_splits(acc, ml, q.dtype)
