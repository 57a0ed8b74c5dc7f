"""The fast FP4-KV decode attention's device time against its split count along T.

``kv_attention_plan.fast_splits`` picks the splits from a model of waves of resident programs. This times the
fast kernel at its default tile for every distinct split count of a list, next to the one the plan picks, so
that the model can be checked against the device. One query token per sequence, NVFP4 per-row K/V of random
values; device times from a CUDA graph of 10 calls, L2 flushed before each (``bench_decode_attn._device_ms``).
One JSON row per (heads, batch, context): ``us`` and ``frac_copy`` per split count (programs = batch x KV heads x
splits), ``planned``, ``best`` and planned / best. Usage (H200, carry .whl):
    python3 benchmarks/bench_attn_splits.py [--heads 16,4,128 32,4,128] [--batches 1,8,64] [--lengths 8192,32768]
        [--splits 1,2,4,8,16,32,64,128]
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_decode_attn import _device_ms, _fp4_bytes

from megatron_trace.config import TraceConfig
from megatron_trace.kernels import kv_attention_plan as plan
from megatron_trace.kernels import kv_attention_triton as kt
from megatron_trace.kernels import quantize
from megatron_trace.kernels.dispatch import cdiv

SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)


def distinct_splits(n_tiles: int, wanted) -> list[int]:
    """The split counts the kernel really runs for ``wanted`` (ceil(n_tiles / per) for per = ceil(n_tiles / s):
    no empty split), deduplicated, ascending."""
    return sorted({cdiv(n_tiles, cdiv(n_tiles, s)) for s in wanted if 1 <= s <= n_tiles})


def one(hq: int, hkv: int, d: int, b: int, length: int, wanted, bw: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b * 7919 + length)
    quant = TraceConfig().activation_quantizer()
    q = torch.randn(b, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (quantize(torch.randn(b, hkv, length, d, generator=g, device="cuda").to(torch.bfloat16), quant,
                     check_finite=False) for _ in range(2))
    bt, nw, ns, mr = plan.fast_config(d)
    n_tiles = cdiv(length, bt)
    resident = plan.FAST_RESIDENT.get((plan.config_key(d), bt, nw, ns, mr), 2)
    planned = plan.fast_splits(b * hkv, n_tiles, plan.sm_count_of(q) * resident)
    nbytes = _fp4_bytes(k) + _fp4_bytes(v)
    us = {}
    for s in sorted(set(distinct_splits(n_tiles, wanted)) | {planned}):
        ms, _ = _device_ms(lambda s=s: kt.decode_attention(q, k, v, scale=d**-0.5, exact=False, splits=s), 5)
        us[s] = round(ms * 1e3, 1)
    best = min(us, key=us.get)
    return {"bench": "attn_splits", "heads": [hq, hkv, d], "batch": b, "context": length, "tile": [bt, nw, ns, mr],
            "resident": resident, "sms": plan.sm_count_of(q), "planned": planned, "best": best,
            "planned_over_best": round(us[planned] / us[best], 3), "us": us,
            "frac_copy": {s: round(nbytes / (t * 1e-6) / bw, 3) for s, t in us.items()},
            "programs": {s: b * hkv * s for s in us}}


def main(argv=None):
    from _timing import copy_bandwidth

    p = argparse.ArgumentParser()
    p.add_argument("--heads", nargs="*", default=["16,4,128", "32,4,128"], help="HQ,HKV,D")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--splits", default=",".join(map(str, SPLITS)))
    args = p.parse_args(argv)
    wanted = [int(s) for s in args.splits.split(",")]
    bw = copy_bandwidth(1 << 29)
    for heads in args.heads:
        hq, hkv, d = map(int, heads.split(","))
        for length in (int(x) for x in args.lengths.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                print(json.dumps(one(hq, hkv, d, b, length, wanted, bw)), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
