"""Host-side guidance paths at long samples (USER_NEEDS.md §7: "test at 64k tokens"): wall time and peak RSS growth
per path, against the guidance payload ``guidance.accounting`` predicts.

    PYTHONPATH=. TORCHDYNAMO_DISABLE=1 python benchmarks/bench_long_context.py [--tokens 1024,4096,16384]
        [--batch8] [--modes compact,full] [--full-max 4096] [--paths split,...,sync] [--tmp DIR]

The defaults run in ~4 min on 2 shared cores; the whole matrix (``--tokens 1024,4096,16384,65536 --batch8``) takes
~10 min more and ~8 GiB of host memory (compact: 2.8 GB of guidance at 64k tokens).

Dims: Qwen3-30B-A3B (tests/data/qwen3_30b_a3b_config.json: 48 layers, 128 experts, top-8, hidden 2048, moe ffn 768,
4 KV heads x 128), the default ``TraceConfig`` (NVFP4, per-row amax, the deepest half guided: 24 layers x 4 sites),
compact and full records. Shapes: one sample of each ``--tokens`` and, with ``--batch8``, 8 samples of 8k tokens
(``8x8192``). Full records above ``--full-max`` tokens per shape are skipped (64k full is 8.3 GB of guidance, held
twice by the split and assembly paths: pass ``--full-max 65536`` on a host with > 24 GiB free).

Records are real: each site's record is quantized by the config's quantizer from random activations for 256
tokens, then tiled along the tokens (one copy per layer). Paths, each on a fresh input, timed once, its peak RSS
growth read as VmHWM - VmRSS after resetting the mark (``/proc/self/clear_refs``):

  split         records.split_batch of the batch-major records (recorder output) -> per-sample views of columns
  recorder      GuidanceRecorder: one prefill step (tokens - 16) + 16 decode steps, then ``finish``
  cache_put/get columns kept by GuidanceCache.put (whole split batch), get + GuidanceCache.assemble
  cache_flat    GuidanceCache.put of samples that are not one split batch (flat host buffer), get
  spill         GuidanceCache with budget 0 and a cache_dir: put writes a shard, get reads it back (all samples at
                once, then one get per sample: a trainer's micro-batches)
  wire          wire.plan_section + layout + write + checksums (the sender's encode), wire.decode (verify)
  assemble      records.assemble of per-sample records; assemble_packed from columns
  routing       split_routing of 48 MoE layers' top-8 ids (uint8), assemble_routing
  pack_step     megatron.packing.pack_step of the assembled micro-batch (sites + routing) into one packed row
  sync          GuidanceSync over gloo, 2 ranks (send / receive_shard), each rank's peak measured in its process

Prints one JSON object: per shape and mode, ``payload`` (the guidance bytes ``accounting`` predicts;
``routing_split`` is measured against its uint8 ids, ``routing_assemble`` against the int64 ids it returns,
``pack_step`` against guidance + int64 ids), and per path ``s`` (wall seconds), ``cpu`` (CPU seconds of this
process: the host is shared, wall time is noisy), ``peak`` (bytes) and ``x`` (peak / payload). One torch thread
(intra-op threads waiting on busy cores made timings 10x noisier); glibc is set to unmap freed allocations, so a
path's peak counts what it allocates.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from megatron_trace.config import TraceConfig  # noqa: E402
from megatron_trace.guidance import accounting  # noqa: E402
from megatron_trace.guidance.model_dims import ModelDims  # noqa: E402
from megatron_trace.guidance.selection import guided_layers  # noqa: E402
from megatron_trace.guidance.site import SiteGuidance  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen3_30b_a3b_config.json"
BASE = 256  # tokens of real quantized rows per site, tiled to the sample length
DECODE = 16  # decode steps of the recorder path
PATHS = ("split", "recorder", "cache", "cache_flat", "spill", "wire", "assemble", "routing", "pack_step", "sync")


def malloc_returns_memory() -> None:
    """glibc: every allocation from 64 KiB on is its own mapping, unmapped when freed (no dynamic mmap threshold, no
    arena reuse of freed tensors), so each path's peak RSS growth counts the memory it allocates."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD


def rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def measured(fn):
    """(result, {"s": wall seconds, "cpu": this process's CPU seconds, "peak": peak RSS growth in bytes}) of
    ``fn()``."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss()["VmRSS"]
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return out, {"s": round(secs, 3), "cpu": round(cpu, 3), "peak": rss()["VmHWM"] - before}


def setup(mode: str):
    dims = ModelDims.from_hf_config(CONFIG)
    config = TraceConfig(cache_mode=mode)
    layers = guided_layers(config, dims.num_layers)
    sites = config.guided_sites
    per_token = accounting.bytes_per_token(dims, sites, layers, **accounting.config_fmt_kw(config))
    return dims, config, layers, sites, per_token


def base_records(dims: ModelDims, config: TraceConfig, sites, compact: bool) -> dict:
    """site -> (FP4Tensor [BASE, ...rows], its record [BASE, ...rows]) quantized from random activations."""
    q, g = config.activation_quantizer(), torch.Generator().manual_seed(0)
    out = {}
    for site in sites:
        rows, k = dims.site_rows(site)
        shape = (BASE, k) if site == "expert_fc1_in" else (BASE, rows, k)
        t = q.quantize(torch.randn(*shape, generator=g) * 3)
        out[site] = t, t.guidance(compact)
    return out


def tile(t: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """``t`` [BASE, ...] -> [B, S, ...] (rows repeated along the tokens)."""
    reps = -(-S // t.shape[0])
    return t.repeat(reps, *[1] * (t.dim() - 1))[:S].unsqueeze(0).expand(B, *[-1] * t.dim()).contiguous()


def tiled_record(rec, B: int, S: int):
    from megatron_trace.rollout.recorder import map_record

    return map_record(rec, lambda x: tile(x, B, S), (B, S, *rec.shape[1:]))


def make_batch(dims, layers, sites, base, B: int, S: int) -> dict:
    """Batch-major guidance {key: SiteGuidance [B, S, ...]}, every token valid, one copy per layer."""
    g = torch.Generator().manual_seed(1)
    ones = torch.ones(B, S, dtype=torch.bool)
    out = {}
    for layer in layers:
        for site in sites:
            rec = tiled_record(base[site][1], B, S)
            if site == "expert_fc2_in":
                ids = torch.randint(0, dims.num_experts, (B, S, dims.topk), generator=g)
                out[(layer, site)] = SiteGuidance(rec, ones[..., None].expand(B, S, dims.topk).clone(), ids)
            else:
                out[(layer, site)] = SiteGuidance(rec, ones.clone())
    return out


def tokens_of(B: int, S: int) -> torch.Tensor:
    return torch.randint(0, 150_000, (B, S), generator=torch.Generator().manual_seed(2))


def routing_of(dims: ModelDims, B: int, S: int) -> dict:
    g = torch.Generator().manual_seed(3)
    return {layer: torch.randint(0, dims.num_experts, (B, S, dims.topk), generator=g) for layer in dims.moe_layers}


def run_recorder(dims, config, layers, sites, base, B, S, compact):
    from megatron_trace.formats import FP4Tensor
    from megatron_trace.rollout.recorder import GuidanceRecorder, map_record

    keys = {(layer, s) for layer in layers for s in sites}
    prefill = S - DECODE

    def rows(site, t):  # [BASE, ...] (an FP4Tensor or record) -> [B * t, ...]
        q, rec = base[site]
        fp4 = map_record(rec, lambda x: tile(x, B, t).flatten(0, 1), (B * t, *rec.shape[1:]))
        full = FP4Tensor(codes=tile(q.codes, B, t).flatten(0, 1), block_scales=fp4.block_scales,
                         global_amax=fp4.global_amax, shape=(B * t, *q.shape[1:]), fmt=q.fmt)
        return full, (fp4 if compact else None)

    steps = [(prefill, {s: rows(s, prefill) for s in sites})] + [(1, {s: rows(s, 1) for s in sites})] * DECODE

    def go():
        r = GuidanceRecorder(B, keys, compact, kernel="reference")
        for t, inputs in steps:
            for layer in layers:
                r.add_routing(layer, torch.zeros(B * t, dims.topk, dtype=torch.int64))
                for site in sites:
                    q, rec = inputs[site]
                    r.add_rows(layer, site, q, rec)
            r.end_step(torch.ones(B, t, dtype=torch.bool))
        index = torch.arange(S)[None].expand(B, S)
        return r.finish(index, torch.ones(B, S, dtype=torch.bool))

    return go


def local_paths(a, mode: str, B: int, S: int) -> dict:
    from megatron_trace.guidance.cache import GuidanceCache
    from megatron_trace.guidance.packed_assemble import assemble_packed
    from megatron_trace.guidance.records import assemble, split_batch
    from megatron_trace.guidance.routing import assemble_routing, split_routing
    from megatron_trace.guidance.site import FallbackCounter
    from megatron_trace.guidance.wire import add_field_checksums, decode, layout, plan_section, write
    from megatron_trace.megatron.context import StepGuidance
    from megatron_trace.megatron.packing import pack_step

    dims, config, layers, sites, per_token = setup(mode)
    compact = mode == "compact"
    payload = per_token * B * S
    base = base_records(dims, config, sites, compact)
    tok = tokens_of(B, S)
    out = {"payload": payload, "bytes_per_token": per_token}

    def put(name, fn, nbytes=payload):
        res, m = measured(fn)
        out[name] = {**m, "x": round(m["peak"] / nbytes, 2)}
        return res

    want = set(a.paths)
    batch = [make_batch(dims, layers, sites, base, B, S)]
    samples = put("split", lambda: split_batch(batch[0], tok, version=0))
    out["guidance_nbytes"] = sum(s.guidance_nbytes() for s in samples)
    batch.clear()  # (the records: freed before the next path)
    if "recorder" in want:
        go = run_recorder(dims, config, layers, sites, base, B, S, compact)
        res = put("recorder", go)
        del res, go
    ids = list(range(B))
    if "cache" in want:
        cache = GuidanceCache(1 << 62)
        put("cache_put", lambda: cache.put(0, samples))
        put("cache_get", lambda: cache.get(0, ids))
        res = put("cache_assemble", lambda: cache.assemble(0, ids, tok, versions=0, counter=FallbackCounter()))
        cache.close()
        del cache, res
    if "cache_flat" in want:
        import dataclasses

        loose = [dataclasses.replace(s, source=None) for s in samples]  # not views of one split batch: flat
        cache = GuidanceCache(1 << 62)
        put("cache_flat_put", lambda: cache.put(0, loose))
        res = put("cache_flat_get", lambda: cache.get(0, ids))
        cache.close()
        del cache, res, loose
    if "spill" in want:
        with tempfile.TemporaryDirectory(dir=a.tmp) as d:
            cache = GuidanceCache(0, d)
            put("spill_put", lambda: cache.put(0, samples))
            res = put("spill_get", lambda: cache.get(0, ids))
            del res
            res = put("spill_get_each", lambda: [cache.get(0, [i]) for i in ids])  # one micro-batch per sample
            out["spill_disk_bytes"] = cache.disk_bytes
            cache.close()
            del cache, res
    if "wire" in want:
        def encode():
            sec = plan_section(samples, "guidance")
            buf = torch.empty(layout([sec]), dtype=torch.uint8)
            write([sec], buf)
            add_field_checksums([sec], buf)
            return sec.head, buf

        head, buf = put("wire_encode", encode)
        res = put("wire_decode", lambda: decode({"protocol": 6, "guidance": head, "routing": None}, buf,
                                                verify=True))
        del head, buf, res
    if "assemble" in want:
        res = put("assemble", lambda: assemble(samples, tok, versions=0, counter=FallbackCounter()))
        del res
        res = put("assemble_packed", lambda: assemble_packed([samples[0].source[0]], ids, tok, versions=0,
                                                             counter=FallbackCounter()))
        del res
    routing_payload = B * S * len(dims.moe_layers) * dims.topk  # uint8 ids
    if "routing" in want or "pack_step" in want:
        routing = routing_of(dims, B, S)
        rs = put("routing_split", lambda: split_routing(routing, tok, version=0, num_experts=dims.num_experts),
                 routing_payload)
        del routing
        out["routing_payload"] = routing_payload
        # [B, S, topk] int64 ids, the trainer's (RouterReplay) layout: measured against those bytes
        step_routing = put("routing_assemble", lambda: assemble_routing(rs, tok, versions=0), 8 * routing_payload)
        if "pack_step" in want:
            step_sites = assemble_packed([samples[0].source[0]], ids, tok, versions=0, counter=FallbackCounter())
            step = StepGuidance(sites=step_sites, routing=step_routing, token_mask=torch.ones(B, S, dtype=torch.bool))
            cu = torch.arange(B + 1, dtype=torch.int32) * S
            res = put("pack_step", lambda: pack_step(step, cu), payload + 8 * routing_payload)
            del res, step, step_sites
        del step_routing
        del rs
    return out


def sync_worker(rank: int, port: int, mode: str, B: int, S: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_trace.guidance.records import split_batch
    from megatron_trace.guidance.sync import GuidanceSync

    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        malloc_returns_memory()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=600))
        dims, config, layers, sites, per_token = setup(mode)
        samples = None
        if rank == 0:
            base = base_records(dims, config, sites, mode == "compact")
            samples = split_batch(make_batch(dims, layers, sites, base, B, S), tokens_of(B, S), version=0)
        sync = GuidanceSync(0, [1], timeout=timedelta(seconds=600))
        dist.barrier()
        fn = (lambda: sync.send(samples)) if rank == 0 else sync.receive_shard
        res, m = measured(fn)
        with open(f"{out}.rank{rank}", "w") as f:
            json.dump({**m, "x": round(m["peak"] / (per_token * B * S), 2)}, f)
        del res
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        with open(f"{out}.err{rank}", "w") as f:
            f.write(traceback.format_exc())


def sync_pair(a, mode: str, B: int, S: int) -> dict:
    from megatron_trace.testing.megatron_cpu import free_port, spawn_ranks

    out = os.path.join(a.tmp, f"sync_{mode}_{B}x{S}")
    port = free_port()
    codes = spawn_ranks(sync_worker, 2, lambda r: (r, port, mode, B, S, out), timeout=900)
    res = {}
    for r, name in ((0, "sync_send"), (1, "sync_receive")):
        p = Path(f"{out}.rank{r}")
        res[name] = json.loads(p.read_text()) if p.exists() else {
            "error": Path(f"{out}.err{r}").read_text()[-400:] if Path(f"{out}.err{r}").exists() else codes}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,4096,16384", help="tokens of the one-sample shapes")
    ap.add_argument("--batch8", action=argparse.BooleanOptionalAction, default=False, help="8 samples of 8k tokens")
    ap.add_argument("--modes", default="compact,full")
    ap.add_argument("--full-max", type=int, default=4096, help="largest B*S run with full records")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--tmp", default=None, help="where the spill shards go (default: the system temp dir)")
    a = ap.parse_args()
    a.paths = a.paths.split(",")
    bad = sorted(set(a.paths) - set(PATHS))
    if bad:
        ap.error(f"--paths {bad}: valid are {PATHS}")
    a.tmp = a.tmp or tempfile.gettempdir()
    malloc_returns_memory()
    torch.set_num_threads(1)  # a shared host: intra-op threads wait on busy cores (10x slower, noisy)
    shapes = [(1, int(n)) for n in a.tokens.split(",")] + ([(8, 8192)] if a.batch8 else [])
    results = {}
    for mode in a.modes.split(","):
        for B, S in shapes:
            if mode == "full" and B * S > a.full_max:
                continue
            key = f"{mode}/{B}x{S}"
            t0 = time.perf_counter()
            results[key] = local_paths(a, mode, B, S)
            if "sync" in a.paths:
                results[key].update(sync_pair(a, mode, B, S))
            results[key]["total_s"] = round(time.perf_counter() - t0, 1)
            print(f"{key}: {results[key]['total_s']} s", file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
