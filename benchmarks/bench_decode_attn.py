"""Per-layer decode attention at context L: BF16 KV vs FP4 KV (dequantize + SDPA) vs the fused FP4-KV kernels.

One query token per sequence, the model's heads (GQA). For each (batch, L): the time of
  bf16        SDPA (``enable_gqa``) over bf16 K/V [B, Hkv, L, D];
  fp4         Triton dequantize of the FP4 K/V history to bf16, then the same SDPA (what ``FP4KVCache`` does);
  fused       the exact fused kernel (``decode_attention(exact=True)``: the reference's bf16 K/V in registers)
              at (block_t, num_warps) (64, 4), and its variants fused_w8 (64, 8), fused_bt32 (32, 4) (the keys
              ``bench_decode.tune_attention`` reads);
  fused_fast  the fast fused kernel at its defaults (``kernels.kv_attention.fp4kv_decode_attention(exact=False)``,
              the rollout's default: K/V as exact FP4 values), and ``fast_bt{BT}_w{warps}_s{stages}[_r{max_registers}]``
              for the launch configs in ``FAST_ALT``; with ``--mask`` also fused_fast_mask (an all-attended kv_mask,
              read as int32 words), fused_fast_mask_bytes (read a byte per token: session 8's loads),
              fused_fast_interval (the same rows as ``starts`` / ``lengths``: generate's interval masks), and
              fused_fast_{mask,interval}_pad (row i of B left-padded by i / (B-1) x L/2 tokens), and
              fused_fast_rows / fused_fast_interval_rows (K/V views of L rows in buffers of L rounded up to 16 rows,
              zeros after L, with ``readable_rows``: the loads' bound a multiple of 16, as the rollout's cache);
Times are device times (``_device_ms``: a CUDA graph of 10 calls, L2 flushed before each; since session 8),
with the KV bytes each reads (bf16 bytes for bf16, the FP4 bytes for the others) and that rate as a fraction of
the copy bandwidth (``*_frac_copy``), and the fused kernels' relative errors against SDPA over the bf16
dequantized K/V (``*_rel_err``; the fast one also against fp32 K/V, its own values: ``fast_rel_err_fp32``).
Used by ``bench_decode.py --attn-micro``; alone: ``python benchmarks/bench_decode_attn.py [--batches ..]
[--lengths ..] [--heads HQ,HKV,D] [--alt BT,warps,stages,max_registers ..] [--mask]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import torch.nn.functional as F

from megatron_trace.config import TraceConfig
from megatron_trace.kernels import dequantize, quantize
from megatron_trace.kernels.kv_attention import fp4kv_decode_attention


def _fp4_bytes(t) -> int:
    n = t.codes.numel() + t.block_scales.numel()
    return n + (t.global_amax.numel() * 4 if t.global_amax is not None else 0)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)


FAST_ALT = ((128, 4, 2, 0), (128, 4, 3, 0), (128, 4, 2, 128), (64, 4, 2, 0))
"""Alternative (block_t, num_warps, num_stages, max_registers; 0: uncapped) of the fast kernel timed next to its
defaults."""
EXACT_VARIANTS = {"fused": (64, 4), "fused_w8": (64, 8), "fused_bt32": (32, 4)}


def _rel(a, b) -> float:
    return round(float((a.float() - b.float()).norm() / b.float().norm()), 5)


def _device_ms(fn, reps: int) -> tuple[float, str]:
    """(ms, timer): device time per call from a CUDA graph of 10 calls (``graph_ms``: no host in it; at batch 8
    the host's launch time exceeds the kernels'), or CUDA-event medians where capture fails."""
    from _timing import graph_ms, median_ms

    try:
        return graph_ms(fn), "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return median_ms(fn, reps=reps), "events"


def _rows_view(t, n: int):
    """The first n rows of an FP4 K/V [B, H, T', D] as a view (per-row amax)."""
    return dataclasses.replace(t, codes=t.codes[:, :, :n], block_scales=t.block_scales[:, :, :n],
                               global_amax=t.global_amax[:, :, :n], shape=(*t.shape[:2], n, t.shape[3]))


def _bytes_mask(fn):
    """fn() with the kv_mask read a byte per token (``kv_attention_plan.MASK_AS_WORDS`` off: the A/B of --mask)."""
    from megatron_trace.kernels import kv_attention_plan

    kv_attention_plan.MASK_AS_WORDS = False
    try:
        return fn()
    finally:
        kv_attention_plan.MASK_AS_WORDS = True


def _one(b, length, hq, hkv, d, quant, device, bw, reps, alt=FAST_ALT, mask=False) -> dict:

    from megatron_trace.kernels import kv_attention_plan
    from megatron_trace.kernels import kv_attention_triton as kt

    g = torch.Generator(device=device).manual_seed(b * 100003 + length)
    q = torch.randn(b, hq, d, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(b, hkv, length, d, generator=g, device=device).to(torch.bfloat16)
    v = torch.randn(b, hkv, length, d, generator=g, device=device).to(torch.bfloat16)
    kq = quantize(k, quant, check_finite=False)
    vq = quantize(v, quant, check_finite=False)
    scale = d**-0.5
    kv_mask = torch.ones(b, length, dtype=torch.bool, device=device)  # (--mask: all attended, as a decode passes)
    starts, ends = torch.zeros(b, dtype=torch.int32, device=device), torch.full((b,), length, device=device)
    pad = (torch.arange(b, device=device) * (length / 2 / max(b - 1, 1))).int()
    pad_mask = torch.arange(length, device=device) >= pad[:, None]
    rows16 = -(-length // 16) * 16
    if mask:  # K/V views of `length` rows in buffers of rows16 (zeros after), as FP4KVCache's (``readable_rows``)
        kq16, vq16 = (_rows_view(quantize(F.pad(x, (0, 0, 0, rows16 - length)), quant, check_finite=False), length)
                      for x in (k, v))
    ref = _sdpa(q, dequantize(kq, torch.bfloat16), dequantize(vq, torch.bfloat16))
    ref32 = _sdpa(q.float(), dequantize(kq, torch.float32), dequantize(vq, torch.float32))
    fast = fp4kv_decode_attention(q, kq, vq, exact=False)
    errs = {"fused_rel_err": _rel(kt.decode_attention(q, kq, vq, scale=scale, exact=True), ref),
            "fast_rel_err": _rel(fast, ref), "fast_rel_err_fp32": _rel(fast, ref32)}
    del ref32
    runs = {
        "bf16": lambda: _sdpa(q, k, v),
        "fp4": lambda: _sdpa(q, dequantize(kq, torch.bfloat16), dequantize(vq, torch.bfloat16)),
        **{name: (lambda bt=bt, nw=nw: kt.decode_attention(q, kq, vq, scale=scale, exact=True, block_t=bt,
                                                           num_warps=nw))
           for name, (bt, nw) in EXACT_VARIANTS.items()},
        "fused_fast": lambda: fp4kv_decode_attention(q, kq, vq, exact=False),
        **({"fused_fast_mask": lambda: fp4kv_decode_attention(q, kq, vq, exact=False, kv_mask=kv_mask),
            "fused_fast_mask_bytes": lambda: _bytes_mask(
                lambda: fp4kv_decode_attention(q, kq, vq, exact=False, kv_mask=kv_mask)),
            "fused_fast_interval": lambda: fp4kv_decode_attention(q, kq, vq, exact=False, starts=starts, lengths=ends),
            "fused_fast_mask_pad": lambda: fp4kv_decode_attention(q, kq, vq, exact=False, kv_mask=pad_mask),
            "fused_fast_interval_pad": lambda: fp4kv_decode_attention(q, kq, vq, exact=False, starts=pad,
                                                                      lengths=ends),
            "fused_fast_rows": lambda: fp4kv_decode_attention(q, kq16, vq16, exact=False, readable_rows=rows16),
            "fused_fast_interval_rows": lambda: fp4kv_decode_attention(q, kq16, vq16, exact=False, starts=starts,
                                                                       lengths=ends, readable_rows=rows16),
            } if mask else {}),
        **{f"fast_bt{bt}_w{nw}_s{ns}" + (f"_r{mr}" if mr else ""): (
            lambda bt=bt, nw=nw, ns=ns, mr=mr: kt.decode_attention(
                q, kq, vq, scale=scale, exact=False, block_t=bt, num_warps=nw, num_stages=ns, max_registers=mr))
           for bt, nw, ns, mr in alt if (bt, nw, ns, mr) != kv_attention_plan.fast_config(d)},
    }
    timed = {name: _device_ms(fn, reps) for name, fn in runs.items()}
    ms = {name: t for name, (t, _) in timed.items()}
    bytes_bf16 = 2 * k.numel() * 2
    bytes_fp4 = _fp4_bytes(kq) + _fp4_bytes(vq)
    frac = {f"{n}_frac_copy": round((bytes_bf16 if n == "bf16" else bytes_fp4) / (t * 1e-3) / bw, 3)
            for n, t in ms.items()}
    return {"bench": "decode_attn", "batch": b, "context": length, "heads": [hq, hkv, d],
            "fast_config": list(kv_attention_plan.fast_config(d)),
            **{f"{n}_us": round(t * 1e3, 1) for n, t in ms.items()},
            "timers": sorted({how for _, how in timed.values()}),
            "fused_over_bf16": round(ms["bf16"] / ms["fused"], 3),
            "fused_over_fp4": round(ms["fp4"] / ms["fused"], 3),
            "fused_fast_over_bf16": round(ms["bf16"] / ms["fused_fast"], 3),
            "fused_fast_over_fused": round(ms["fused"] / ms["fused_fast"], 3),
            **frac, **errs, "kv_bytes_bf16": bytes_bf16, "kv_bytes_fp4": bytes_fp4, "copy_TBps": round(bw / 1e12, 3)}


def attention_micro(hf_config, batches, lengths, device, *, budget_left=None, reps: int = 20, alt=FAST_ALT,
                    mask: bool = False):
    """Yields one JSON-able row per (batch, L) (see the module docstring)."""
    from _timing import copy_bandwidth

    bw = copy_bandwidth(1 << 29)
    hq, hkv, d = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.head_dim
    quant = TraceConfig().activation_quantizer()
    t0 = time.perf_counter()
    for length in lengths:
        for b in batches:
            if budget_left is not None and time.perf_counter() - t0 > 0.25 * budget_left:
                yield {"bench": "decode_attn_skipped", "batch": b, "context": length, "reason": "budget"}
                continue
            try:
                yield _one(b, length, hq, hkv, d, quant, device, bw, reps, alt, mask)
            except Exception as e:  # noqa: BLE001 - reported, the next point still runs
                yield {"bench": "decode_attn", "batch": b, "context": length,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
            finally:
                torch.cuda.empty_cache()


def main(argv=None):
    from bench_decode import MODEL
    from transformers import Qwen3MoeConfig

    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--lengths", default="1024,8192,32768")
    p.add_argument("--heads", default=None, help="HQ,HKV,D instead of the decode model's (e.g. 16,4,64)")
    p.add_argument("--alt", nargs="*", default=None,
                   help="BT,warps,stages,max_registers configs instead of FAST_ALT (none: --alt alone)")
    p.add_argument("--mask", action="store_true",
                   help="also time the fast kernel with an all-attended kv_mask (the rollout's decode passes one), "
                        "read as int32 words (default) and as bytes")
    args = p.parse_args(argv)
    model = dict(MODEL)
    if args.heads:
        model["num_attention_heads"], model["num_key_value_heads"], model["head_dim"] = map(int, args.heads.split(","))
    alt = tuple(tuple(int(x) for x in c.split(",")) for c in args.alt) if args.alt is not None else FAST_ALT
    for row in attention_micro(Qwen3MoeConfig(**model), [int(b) for b in args.batches.split(",")],
                               [int(v) for v in args.lengths.split(",")], torch.device("cuda"), alt=alt,
                               mask=args.mask):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
