"""The colocated driver's guidance round trip per RL step: split -> GuidanceCache.put -> assemble for the trainer.

    python benchmarks/bench_cache_assemble.py [--batch 256 --seq 16 --layers 4 --reps 5]

Shapes default to the GPU RL config's guided half (4 layers x FC1 hidden 256, FC2 top-4 x 128, K/V 4 heads x 32,
compact NVFP4, 32 prompts x 8 samples of ~16 tokens). Three paths: ``per_sample`` (the batch put in two parts,
flat per-sample buffers, ``get`` + ``records.assemble``: what every step paid first), ``columns`` (``split_batch``
samples whose columns the cache keeps, ``GuidanceCache.assemble`` from them) and ``packed`` (``pack_guidance``: the
columns without per-sample views, what the colocated driver does now). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.cache import GuidanceCache
from megatron_trace.guidance.records import assemble, pack_guidance, split_batch
from megatron_trace.guidance.site import FallbackCounter, SiteGuidance


def batch(b: int, s: int, layers: int, device: str) -> dict:
    q, g = TraceConfig().activation_quantizer(), torch.Generator().manual_seed(0)
    ones = torch.ones(b, s, dtype=torch.bool)
    out = {}
    for layer in range(layers):
        def rec(*shape):
            return q.quantize(torch.randn(b, s, *shape, generator=g).to(device)).guidance(compact=True)

        out[(layer, "expert_fc1_in")] = SiteGuidance(rec(256), ones.to(device), None)
        out[(layer, "expert_fc2_in")] = SiteGuidance(rec(4, 128), ones[..., None].expand(b, s, 4).to(device),
                                                     torch.randint(0, 32, (b, s, 4), generator=g).to(device))
        for kv in ("kv_k", "kv_v"):
            out[(layer, kv)] = SiteGuidance(rec(4, 32), ones.to(device), None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    sites = batch(a.batch, a.seq, a.layers, a.device)
    tokens = torch.randint(0, 30, (a.batch, a.seq))
    mask = torch.ones(a.batch, a.seq, dtype=torch.bool)
    cache = GuidanceCache(1 << 32)

    def per_sample(step: int) -> None:
        samples = split_batch(sites, tokens.to(a.device), version=0, attention_mask=mask.to(a.device))
        cache.put(step, samples[:-1])
        cache.put(step, samples[-1:])
        got = cache.get(step, [s.sample_id for s in samples])
        assemble(got, tokens, versions=0, attention_mask=mask, counter=FallbackCounter())
        cache.drop(step)

    def columns(step: int) -> None:
        samples = split_batch(sites, tokens.to(a.device), version=0, attention_mask=mask.to(a.device))
        cache.put(step, samples)
        cache.assemble(step, [s.sample_id for s in samples], tokens, versions=0, attention_mask=mask,
                       counter=FallbackCounter())
        cache.drop(step)

    def packed(step: int) -> None:  # what the colocated driver does: no per-sample views at all
        cols = pack_guidance(sites, tokens.to(a.device), version=0, attention_mask=mask.to(a.device))
        cache.put(step, cols)
        cache.assemble(step, list(cols.table.ids), tokens, versions=0, attention_mask=mask, counter=FallbackCounter())
        cache.drop(step)

    row = {"bench": "cache_assemble", "batch": a.batch, "seq": a.seq, "layers": a.layers, "device": a.device,
           "threads": torch.get_num_threads()}
    for name, fn in (("per_sample", per_sample), ("columns", columns), ("packed", packed)):
        fn(0)
        times = []
        for i in range(a.reps):
            t0 = time.perf_counter()
            fn(i + 1)
            times.append(time.perf_counter() - t0)
        row[f"{name}_s"] = round(statistics.median(times), 4)
    row["speedup"] = round(row["per_sample_s"] / row["columns_s"], 2)
    row["speedup_packed"] = round(row["per_sample_s"] / row["packed_s"], 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
