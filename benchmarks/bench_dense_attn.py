"""Decode attention over BF16 K/V: the dense Triton kernel (``kernels.kv_attention_dense_triton``, a static cache's
unquantized layers) at launch configs, against SDPA and the FP4 fast kernel on the same rows.

Per (heads, batch, context L), K/V rows held in buffers of L rounded up to 16 (zeros after L, ``readable_rows``)
and every row's interval [0, L) given as ``starts`` / ``lengths`` (the static decode's masks):
  sdpa          SDPA (``enable_gqa``) over the L rows, no mask (flash / cuDNN: the best BF16 path, what a growing
                cache's decode gets);
  sdpa_masked   SDPA over the buffer with a bool mask [B, 1, 1, rows] (what a static step's SDPA gets; K/V repeated
                per query head as transformers does for a masked GQA call);
  dense         the dense kernel at its default config, and ``dense_bt{BT}_w{warps}_s{stages}`` for ``--configs``;
  fp4_fast      the FP4 fast kernel (the rollout's FP4 layers) over the same rows quantized (NVFP4 per row).
Device times from CUDA graphs (``_timing.graph_ms``), the bytes each reads and that rate over the copy bandwidth
(``*_frac_copy``); ``dense_rel_err``: against the fp32 reference. One JSON line per point. Usage (H200):
    python3 benchmarks/bench_dense_attn.py [--heads 16,4,128 32,4,128] [--batches 8,64] [--lengths 1024,8192,32768]
        [--configs 64,4,3 32,4,3 128,4,2 ...]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from _timing import copy_bandwidth, graph_ms, machine

from megatron_trace.config import TraceConfig
from megatron_trace.kernels import kv_attention_dense_triton as dense
from megatron_trace.kernels.kv_attention import dense_decode_attention, fp4kv_decode_attention

CONFIGS = ("32,4,3", "64,4,2", "64,4,4", "64,8,3", "128,4,2", "128,8,2", "32,2,3", "64,2,3")


def point(hq: int, hkv: int, d: int, b: int, t: int, configs, copy_bw: float) -> dict:
    rows = -(-t // 16) * 16
    g = torch.Generator(device="cuda").manual_seed(b * 7 + t)
    q = torch.randn(b, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.zeros(b, hkv, rows, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for x in (k, v):
        x[:, :, :t] = torch.randn(b, hkv, t, d, generator=g, device="cuda", dtype=torch.bfloat16)
    starts = torch.zeros(b, dtype=torch.int32, device="cuda")
    lengths = torch.full((b,), t, dtype=torch.int32, device="cuda")
    scale = d**-0.5
    want = dense_decode_attention(q, k[:, :, :t], v[:, :, :t], kernel="reference")
    mask = torch.zeros(b, 1, 1, rows, dtype=torch.bool, device="cuda")
    mask[..., :t] = True
    kv_bytes = 2 * b * hkv * t * d * 2
    row = {"bench": "dense_attn", "heads": [hq, hkv, d], "batch": b, "context": t, "kv_bytes": kv_bytes}

    def put(name, fn, nbytes=kv_bytes):
        try:
            ms = graph_ms(fn)
        except Exception as e:  # noqa: BLE001 - a config that does not compile must not lose the point
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            return
        row[f"{name}_us"] = round(ms * 1e3, 1)
        row[f"{name}_frac_copy"] = round(nbytes / (ms * 1e-3) / copy_bw, 3)

    put("sdpa", lambda: F.scaled_dot_product_attention(q[:, :, None], k[:, :, :t], v[:, :, :t], enable_gqa=True))

    def masked():
        rep = hq // hkv
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q[:, :, None], kk, vv, attn_mask=mask)

    if b * hq * rows * d * 2 * 2 < 24 << 30:
        put("sdpa_masked", masked)
    args = dict(scale=scale, starts=starts, lengths=lengths, readable_rows=rows)
    got = dense.decode_attention(q, k[:, :, :t], v[:, :, :t], **args)
    row["dense_rel_err"] = round(float((got.float() - want.float()).norm() / want.float().norm()), 5)
    put("dense", lambda: dense.decode_attention(q, k[:, :, :t], v[:, :, :t], **args))
    for c in configs:
        bt, nw, ns = (int(x) for x in c.split(","))
        put(f"dense_bt{bt}_w{nw}_s{ns}", lambda bt=bt, nw=nw, ns=ns: dense.decode_attention(
            q, k[:, :, :t], v[:, :, :t], block_t=bt, num_warps=nw, num_stages=ns, **args))
    quant = TraceConfig().kv_quantizer()
    kq, vq = quant.quantize(k[:, :, :t]), quant.quantize(v[:, :, :t])
    fp4_bytes = sum(x.codes.numel() + x.block_scales.numel() + 4 * b * hkv * t for x in (kq, vq))
    put("fp4_fast", lambda: fp4kv_decode_attention(q, kq, vq, scale=scale, exact=False, starts=starts,
                                                   lengths=lengths), fp4_bytes)
    best = min((key for key in row if key.startswith("dense") and key.endswith("_us")), key=row.get)
    row["best_dense"] = best[:-3]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", nargs="+", default=["16,4,128", "32,4,128"])
    p.add_argument("--batches", default="8,64")
    p.add_argument("--lengths", default="1024,8192,32768")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS))
    a = p.parse_args(argv)
    bw = copy_bandwidth()
    print(json.dumps({"bench": "dense_attn_setup", **machine(), "copy_gbps": round(bw / 1e9, 1),
                      "default": list(dense.DENSE_CONFIG)}), flush=True)
    for heads in a.heads:
        hq, hkv, d = (int(x) for x in heads.split(","))
        for b in (int(x) for x in a.batches.split(",")):
            for t in (int(x) for x in a.lengths.split(",")):
                print(json.dumps(point(hq, hkv, d, b, t, a.configs, bw)), flush=True)


if __name__ == "__main__":
    main()
