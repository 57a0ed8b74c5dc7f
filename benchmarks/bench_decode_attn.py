"""Per-layer decode attention at context L: BF16 KV vs FP4 KV (dequantize + SDPA) vs fused FP4-KV kernel.

One query token per sequence, the model's heads (GQA). For each (batch, L): the time of
  bf16    SDPA (``enable_gqa``) over bf16 K/V [B, Hkv, L, D];
  fp4     Triton dequantize of the FP4 K/V history to bf16, then the same SDPA (what ``FP4KVCache`` does);
  fused   ``kernels.kv_attention.fp4kv_decode_attention`` (dequantize in registers, never writes bf16 K/V),
          and its variants: scale folding (``exact=False``), 8 warps, 32-token tiles;
with the KV bytes each reads and that rate as a fraction of the copy bandwidth. Used by
``bench_decode.py --attn-micro``; alone: ``python benchmarks/bench_decode_attn.py [--batches ..] [--lengths ..]``.
"""

from __future__ import annotations

import argparse
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


def _one(b, length, hq, hkv, d, quant, device, bw, reps) -> dict:
    from _timing import median_ms

    from megatron_trace.kernels import kv_attention_triton

    g = torch.Generator(device=device).manual_seed(b * 100003 + length)
    q = torch.randn(b, hq, d, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(b, hkv, length, d, generator=g, device=device).to(torch.bfloat16)
    v = torch.randn(b, hkv, length, d, generator=g, device=device).to(torch.bfloat16)
    kq = quantize(k, quant, check_finite=False)
    vq = quantize(v, quant, check_finite=False)
    kd, vd = dequantize(kq, torch.bfloat16), dequantize(vq, torch.bfloat16)
    ref = _sdpa(q, kd, vd)
    fused = fp4kv_decode_attention(q, kq, vq)
    err = float((fused.float() - ref.float()).norm() / ref.float().norm())
    del kd, vd
    ms = {
        "bf16": median_ms(lambda: _sdpa(q, k, v), reps=reps),
        "fp4": median_ms(lambda: _sdpa(q, dequantize(kq, torch.bfloat16), dequantize(vq, torch.bfloat16)), reps=reps),
        "fused": median_ms(lambda: kv_attention_triton.decode_attention(q, kq, vq, scale=d**-0.5, block_t=64,
                                                                        num_warps=4), reps=reps),
        "fused_fast": median_ms(lambda: kv_attention_triton.decode_attention(q, kq, vq, scale=d**-0.5, exact=False),
                                reps=reps),
        "fused_w8": median_ms(lambda: kv_attention_triton.decode_attention(q, kq, vq, scale=d**-0.5, block_t=64,
                                                                           num_warps=8), reps=reps),
        "fused_bt32": median_ms(lambda: kv_attention_triton.decode_attention(q, kq, vq, scale=d**-0.5, block_t=32,
                                                                             num_warps=4), reps=reps),
    }
    fast = kv_attention_triton.decode_attention(q, kq, vq, scale=d**-0.5, exact=False)
    err_fast = float((fast.float() - ref.float()).norm() / ref.float().norm())
    bytes_bf16 = 2 * k.numel() * 2
    bytes_fp4 = _fp4_bytes(kq) + _fp4_bytes(vq)
    return {"bench": "decode_attn", "batch": b, "context": length, "heads": [hq, hkv, d],
            **{f"{n}_us": round(t * 1e3, 1) for n, t in ms.items()},
            "fused_over_bf16": round(ms["bf16"] / ms["fused"], 3),
            "fused_over_fp4": round(ms["fp4"] / ms["fused"], 3),
            "fused_fast_over_bf16": round(ms["bf16"] / ms["fused_fast"], 3),
            "fused_fast_frac_copy": round(bytes_fp4 / (ms["fused_fast"] * 1e-3) / bw, 3),
            "fast_rel_err": round(err_fast, 5),
            "bf16_frac_copy": round(bytes_bf16 / (ms["bf16"] * 1e-3) / bw, 3),
            "fused_frac_copy": round(bytes_fp4 / (ms["fused"] * 1e-3) / bw, 3),
            "kv_bytes_bf16": bytes_bf16, "kv_bytes_fp4": bytes_fp4, "fused_rel_err": round(err, 5),
            "copy_TBps": round(bw / 1e12, 3)}


def attention_micro(hf_config, batches, lengths, device, *, budget_left=None, reps: int = 20):
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
                yield _one(b, length, hq, hkv, d, quant, device, bw, reps)
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
    args = p.parse_args(argv)
    cfg = Qwen3MoeConfig(**MODEL)
    for row in attention_micro(cfg, [int(b) for b in args.batches.split(",")],
                               [int(v) for v in args.lengths.split(",")], torch.device("cuda")):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
