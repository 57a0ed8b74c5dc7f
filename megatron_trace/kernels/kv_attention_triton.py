"""Triton decode attention over an FP4 KV cache: dequantize K/V tiles in registers, online softmax (split-T).

One query token per sequence, GQA (``G`` query heads share a KV head). Program (batch x KV head, split):
for each tile of ``BT`` cached tokens of its split, K and V rows are decoded from packed codes, block
scales and the per-row global amax with the same fp32 operations as ``dequant_triton`` (``_unscale``,
then one RNE cast to bf16), i.e. the very bf16 values ``FP4Tensor.dequantize(torch.bfloat16)`` gives;
then ``s = q K^T * scale`` and ``acc += softmax-weights V`` (bf16 MMA, fp32 accumulation). Each split
writes (acc, max, sum); ``combine`` merges the splits. Reads 0.5 + 1/16 + 4/head_dim bytes per K/V element
instead of 2 (bf16) and never writes the dequantized history.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.tensor import FP4Tensor
from . import quant_triton as qk
from . import triton_fp4 as f

SPLIT_WAVES = 4
"""Splits along T are chosen so that about this many programs per multiprocessor run (flash-decoding)."""
BLOCK_T = 64
NUM_WARPS = 4
"""Default tile (cached tokens per step) and warps; sm_90 build without spills: 255 registers at 64/4,
225 at 64/8, 168 at 32/4 (ptxas -v)."""


@triton.jit
def _deq_rows(c_ptr, s_ptr, g_ptr, t, tmask, st_c, st_s, st_g, FMT: tl.constexpr, NB: tl.constexpr,
              B: tl.constexpr, FAST_DIV: tl.constexpr):
    """Rows ``t`` [BT] of one (batch, head): packed codes/scales/amax -> bf16 [BT, NB*B] (the reference's bits)."""
    BT: tl.constexpr = t.shape[0]
    blk = tl.arange(0, NB)[None, :]  # [1, NB]
    off = t[:, None, None] * st_c + blk[:, :, None] * (B // 2) + tl.arange(0, B // 2)[None, None, :]
    p = tl.load(c_ptr + off, mask=tmask[:, None, None], other=0)
    codes = tl.join(p & 15, p >> 4).reshape(BT, NB, B)  # element 2i in the low nibble
    byte = tl.load(s_ptr + t[:, None] * st_s + blk, mask=tmask[:, None], other=0)
    if FMT == f.NVFP4:
        sf = f.e4m3_value(byte)
        e = byte.to(tl.int32)
        s_e = f.nvfp4_encode_scale(tl.load(g_ptr + t * st_g, mask=tmask, other=1.0))[:, None, None]
    else:
        sf = byte.to(tl.float32)
        e = byte.to(tl.int32) - 127
        s_e = 1.0
    out = qk._unscale(codes, sf, e, s_e, FMT, FAST_DIV)
    return f.to_dtype(out.reshape(BT, NB * B), tl.bfloat16)


@triton.jit
def _raw_rows(c_ptr, s_ptr, g_ptr, t, tmask, st_c, st_s, st_g, FMT: tl.constexpr, NB: tl.constexpr,
              B: tl.constexpr):
    """(code value * block scale as bf16 [BT, D] (exact: at most 6 significant bits), 1 / S_enc per row fp32
    [BT]): the fast path folds the per-row factor into the scores (K) and the softmax weights (V)."""
    BT: tl.constexpr = t.shape[0]
    blk = tl.arange(0, NB)[None, :]
    off = t[:, None, None] * st_c + blk[:, :, None] * (B // 2) + tl.arange(0, B // 2)[None, None, :]
    p = tl.load(c_ptr + off, mask=tmask[:, None, None], other=0)
    codes = tl.join(p & 15, p >> 4).reshape(BT, NB, B)
    byte = tl.load(s_ptr + t[:, None] * st_s + blk, mask=tmask[:, None], other=0)
    if FMT == f.NVFP4:
        sf = f.e4m3_value(byte)
        inv = tl.div_rn(1.0 + tl.zeros([BT], tl.float32),
                        f.nvfp4_encode_scale(tl.load(g_ptr + t * st_g, mask=tmask, other=1.0)))
    else:
        sf = f.pow2(byte.to(tl.int32) - 127)
        inv = 1.0 + tl.zeros([BT], tl.float32)
    raw = (f.e2m1_decode(codes) * sf[:, :, None]).reshape(BT, NB * B)
    return raw.to(tl.bfloat16), inv


@triton.jit
def deq_rows_kernel(c_ptr, s_ptr, g_ptr, out_ptr, T, st_c, st_s, st_g, FMT: tl.constexpr, NB: tl.constexpr,
                    B: tl.constexpr, BT: tl.constexpr, FAST_DIV: tl.constexpr):
    """out[T, D] = ``_deq_rows`` of rows 0..T-1 (the attention kernel's dequantization, for tests)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    d = tl.arange(0, NB * B)
    x = _deq_rows(c_ptr, s_ptr, g_ptr, t, tmask, st_c, st_s, st_g, FMT, NB, B, FAST_DIV)
    tl.store(out_ptr + t[:, None] * (NB * B) + d[None, :], x, mask=tmask[:, None])


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """bf16 x bf16 -> fp32 MMA; in fp32 under the CPU interpreter (whose bf16 dot is not usable)."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def fp4kv_decode_attn_kernel(
    q_ptr, kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, len_ptr, mask_ptr, acc_ptr, ml_ptr,
    T, chunk, n_tiles, sm_scale,
    sq_b, sq_h, sm_b,
    skc_b, skc_h, skc_t, sks_b, sks_h, sks_t, skg_b, skg_h, skg_t,
    svc_b, svc_h, svc_t, svs_b, svs_h, svs_t, svg_b, svg_h, svg_t,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, FMT: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
    BT: tl.constexpr, SPLITS: tl.constexpr, HAS_LEN: tl.constexpr, HAS_MASK: tl.constexpr, FAST_DIV: tl.constexpr,
    F32_DOT: tl.constexpr, EXACT: tl.constexpr,
):
    """Partial attention of split ``program_id(1)``: acc [B, Hq, S, D] (unnormalised), ml [B, Hq, S, 2]."""
    D: tl.constexpr = NB * B
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    h = (pid % HKV).to(tl.int64)
    if HAS_LEN:
        n = tl.load(len_ptr + b).to(tl.int32)
    else:
        n = T
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    g = tl.arange(0, GP)
    gmask = g < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (h * G + g)[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.bfloat16)  # [GP, D]
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    kc, ks, kg = kc_ptr + b * skc_b + h * skc_h, ks_ptr + b * sks_b + h * sks_h, kg_ptr + b * skg_b + h * skg_h
    vc, vs, vg = vc_ptr + b * svc_b + h * svc_h, vs_ptr + b * svs_b + h * svs_h, vg_ptr + b * svg_b + h * svg_h
    for i in range(0, n_tiles):  # n_tiles = chunk / BT; tiles past ``end`` load nothing
        t = start + i * BT + tl.arange(0, BT)
        tmask = t < end
        if HAS_MASK:  # kv_mask [B, T] (uint8, 0 = masked): left padding, finished rows
            tmask = tmask & (tl.load(mask_ptr + b * sm_b + t, mask=tmask, other=0) != 0)
        if EXACT:  # K, V = the reference's bf16 dequantized values
            k = _deq_rows(kc, ks, kg, t, tmask, skc_t, sks_t, skg_t, FMT, NB, B, FAST_DIV)  # [BT, D] bf16
            s = _dot(q, tl.trans(k), F32_DOT) * sm_scale  # [GP, BT]
        else:  # K = raw * (1 / S_enc) per row, folded into the scores
            k, k_inv = _raw_rows(kc, ks, kg, t, tmask, skc_t, sks_t, skg_t, FMT, NB, B)
            s = _dot(q, tl.trans(k), F32_DOT) * (k_inv * sm_scale)[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile adds nothing
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if EXACT:
            v = _deq_rows(vc, vs, vg, t, tmask, svc_t, svs_t, svg_t, FMT, NB, B, FAST_DIV)
            pv = p
        else:  # V = raw * (1 / S_enc) per row, folded into the weights
            v, v_inv = _raw_rows(vc, vs, vg, t, tmask, svc_t, svs_t, svg_t, FMT, NB, B)
            pv = p * v_inv[None, :]
        acc = acc * alpha[:, None] + _dot(pv.to(tl.bfloat16), v, F32_DOT)
        m_i = m_new
    row = (b * (HKV * G) + h * G + g) * SPLITS + split  # [GP] index into [B, Hq, S]
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
    tl.store(ml_ptr + row * 2, m_i, mask=gmask)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)


def _parts(t: FP4Tensor):
    """(codes [B,H,T,D/2] uint8, scales [B,H,T,NB] uint8, amax [B,H,T,1] fp32 or a dummy) with their strides."""
    codes, scales = t.codes, t.block_scales.view(torch.uint8)
    if codes.stride(-1) != 1 or scales.stride(-1) != 1:
        codes, scales = codes.contiguous(), scales.contiguous()
    g = t.global_amax
    if g is None:
        g = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=codes.device).expand(*codes.shape[:3], 1)
    elif g.dim() == 0:
        g = g.float().reshape(1, 1, 1, 1).expand(*codes.shape[:3], 1)
    else:
        g = g.float()
    return codes, scales, g


def dequantize_rows(t: FP4Tensor, block_t: int = 64) -> torch.Tensor:
    """The attention kernel's dequantization of a [T, D] FP4 tensor (bf16), for checking its bits."""
    codes, scales, g = _parts(FP4Tensor(codes=t.codes[None, None], block_scales=t.block_scales[None, None],
                                        global_amax=None if t.global_amax is None else
                                        (t.global_amax if t.global_amax.dim() == 0 else t.global_amax[None, None]),
                                        shape=(1, 1, *t.shape), fmt=t.fmt))
    n, d = t.shape
    nb = scales.shape[-1]
    out = torch.empty(n, d, dtype=torch.bfloat16, device=codes.device)
    deq_rows_kernel[(triton.cdiv(n, block_t),)](
        codes, scales, g, out, n, codes.stride(2), scales.stride(2), g.stride(2),
        FMT=0 if t.fmt == "nvfp4" else 1, NB=nb, B=t.block_size, BT=block_t, FAST_DIV=qk.FAST_DIV,
        enable_fp_fusion=False,
    )
    return out


def decode_attention(q: torch.Tensor, k: FP4Tensor, v: FP4Tensor, *, scale: float, lengths=None, kv_mask=None,
                     exact: bool = True, block_t: int | None = None, splits: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """q [B, Hq, D], k/v FP4 [B, Hkv, T, D] -> [B, Hq, D] in q.dtype (see the module docstring).

    ``lengths`` int [B]: tokens per sequence; ``kv_mask`` bool [B, T]: False = not attended.
    ``exact=False``: K/V enter the MMAs as code value x block scale (exact in bf16) and each row's 1/S_enc
    scales its score and its softmax weight instead (fewer operations per element; the effective K/V are then
    the exact FP4 values rather than their bf16 rounding)."""
    block_t, num_warps = block_t or BLOCK_T, num_warps or NUM_WARPS
    bsz, hq, d = q.shape
    _, hkv, t_len, _ = k.shape
    kc, ks, kg = _parts(k)
    vc, vs, vg = _parts(v)
    nb = ks.shape[-1]
    group = hq // hkv
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = max(1, min(triton.cdiv(SPLIT_WAVES * sms, bsz * hkv), triton.cdiv(t_len, block_t)))
    chunk = triton.cdiv(triton.cdiv(t_len, splits), block_t) * block_t
    acc = torch.empty(bsz, hq, splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bsz, hq, splits, 2, dtype=torch.float32, device=q.device)
    lens = lengths.to(device=q.device, dtype=torch.int32).contiguous() if lengths is not None else ml
    mask = kv_mask[:, :t_len].to(device=q.device, dtype=torch.uint8) if kv_mask is not None else ml
    fp4kv_decode_attn_kernel[(bsz * hkv, splits)](
        q, kc, ks, kg, vc, vs, vg, lens, mask, acc, ml, t_len, chunk, chunk // block_t, float(scale),
        q.stride(0), q.stride(1), mask.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        kg.stride(0), kg.stride(1), kg.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        vg.stride(0), vg.stride(1), vg.stride(2),
        HKV=hkv, G=group, GP=max(16, triton.next_power_of_2(group)), FMT=0 if k.fmt == "nvfp4" else 1, NB=nb,
        B=k.block_size, BT=block_t, SPLITS=splits, HAS_LEN=lengths is not None, HAS_MASK=kv_mask is not None,
        FAST_DIV=qk.FAST_DIV, F32_DOT=not q.is_cuda,  # Triton's CPU interpreter: fp32 dots
        EXACT=exact,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return combine(acc, ml).to(q.dtype)


def combine(acc: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """Merge split partials: acc [B, Hq, S, D], ml [B, Hq, S, 2] (max, sum) -> [B, Hq, D] fp32."""
    m, l_sum = ml[..., 0], ml[..., 1]
    mx = m.amax(-1, keepdim=True)
    w = torch.where(m == float("-inf"), 0.0, torch.exp(m - mx))  # empty splits weigh nothing
    return (acc * w.unsqueeze(-1)).sum(-2) / (l_sum * w).sum(-1, keepdim=True)
