"""Guidance transfer costs: ``guidance.sync`` vs a raw send/recv of the same bytes, and ``guidance.cache`` host
offload (device staging -> pinned host) vs the measured pinned copy bandwidth.

    python3 benchmarks/bench_guidance_sync.py           # GPU: 64k tokens x 24 layers of Qwen3-30B-A3B FC1 rows
                                                         # (hidden 2048), compact NVFP4 records
    python3 benchmarks/bench_guidance_sync.py --smoke   # tiny, CPU
    python3 benchmarks/bench_guidance_sync.py --cpu     # 2-core CPU box: 32 x 1024 tokens x 12 layers (~150 MB)
    python3 benchmarks/bench_guidance_sync.py --shape disagg   # one RL step of benchmarks/two_gpu_disagg.py: many
        # small samples (512 x ~14 tokens), 8 layers x (FC1 hidden 256 + FC2 top-4 x 128 with expert ids), compact
        # NVFP4, + routing of 8 layers; sync only (no host offload), send/receive/assemble timed per rank

Two processes (rollout rank 0, trainer rank 1) on the one GPU: NCCL is tried first; NCCL refuses two ranks on
one device, then gloo runs (the JSON says which). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def args_():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in dict(samples=64, seq=1024, hidden=2048, layers=24, warmup=1, reps=3).items():
        p.add_argument("--" + k, type=int, default=v)
    p.add_argument("--shape", choices=("fc1", "disagg"), default="fc1")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cpu", action="store_true", help="a size for a small CPU box (gloo, plain host copy baseline)")
    a = p.parse_args()
    if a.cpu:
        a.__dict__.update(samples=32, seq=1024, hidden=2048, layers=12, warmup=3, reps=5)
    if a.shape == "disagg":
        a.__dict__.update(samples=512, seq=16, hidden=256, layers=8, ffn=128, topk=4, experts=32, warmup=2, reps=5)
    if a.smoke:
        a.__dict__.update(samples=4, seq=32, hidden=64, layers=2, warmup=1, reps=2)
    return a


def make_disagg(a, device):
    """(samples, routing) shaped like one RL step of two_gpu_disagg: per layer compact NVFP4 FC1 [B, S, hidden]
    and FC2 [B, S, topk, ffn] records with expert ids, plus routing; lengths S-4..S (right padding)."""
    from megatron_trace.formats import nvfp4
    from megatron_trace.guidance.records import split_batch
    from megatron_trace.guidance.routing import split_routing
    from megatron_trace.guidance.site import SiteGuidance

    g = torch.Generator().manual_seed(0)
    B, S, k = a.samples, a.seq, a.topk
    lengths = torch.randint(max(1, S - 4), S + 1, (B,), generator=g)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).to(device)  # [B, S]
    tokens = (torch.randint(1, 150_000, (B, S), generator=g) * mask.cpu()).to(device)
    batch, routing = {}, {}
    for layer in range(a.layers):
        x1 = torch.randn(B, S, a.hidden, generator=g).to(device)  # [B, S, hidden]
        x2 = torch.randn(B, S, k, a.ffn, generator=g).to(device)  # [B, S, topk, ffn]
        ids = torch.randint(0, a.experts, (B, S, k), generator=g).to(device)
        batch[(layer, "expert_fc1_in")] = SiteGuidance(nvfp4.quantize(x1, per_row=True).guidance(True), mask.clone())
        batch[(layer, "expert_fc2_in")] = SiteGuidance(nvfp4.quantize(x2, per_row=True).guidance(True),
                                                       mask[..., None].expand(B, S, k).clone(), ids)
        routing[layer] = ids
    samples = split_batch(batch, tokens, version=7, attention_mask=mask)
    return samples, split_routing(routing, tokens, version=7, num_experts=a.experts, attention_mask=mask), tokens, mask


def make_samples(a, device):
    """Compact NVFP4 FC1 records (per-row amax) of ``a.layers`` layers, one SampleGuidance per sequence."""
    from megatron_trace.formats import nvfp4
    from megatron_trace.guidance.records import split_batch
    from megatron_trace.guidance.site import SiteGuidance

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(a.samples, a.seq, a.hidden, generator=g, device=device, dtype=torch.bfloat16)
    rec = nvfp4.quantize(x, per_row=True).guidance(compact=True)
    del x
    valid = torch.ones(a.samples, a.seq, dtype=torch.bool, device=device)
    batch = {(layer, "expert_fc1_in"): SiteGuidance(rec, valid) for layer in range(a.layers)}
    tokens = torch.randint(1, 150_000, (a.samples, a.seq), generator=torch.Generator().manual_seed(0)).to(device)
    return split_batch(batch, tokens, version=7)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, warmup, reps):
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _local_timed(fn, device, reps):
    """Median seconds of ``reps`` calls on this rank alone (no barrier), after one warm-up call."""
    times = []
    for i in range(1 + reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _trainer_assemble(shard, tokens, mask) -> None:
    """What the trainer does with a received shard: batch-major guidance and routing for its micro-batch."""
    from megatron_trace.guidance.records import assemble
    from megatron_trace.guidance.routing import assemble_routing
    from megatron_trace.guidance.site import FallbackCounter

    if hasattr(shard, "assemble"):  # protocol >= 4: columnar, no per-sample objects
        shard.assemble(list(range(tokens.shape[0])), tokens, versions=7, counter=FallbackCounter(),
                       attention_mask=mask)
        return
    samples = sorted(shard.samples, key=lambda s: s.sample_id)
    assemble(samples, tokens, versions=7, counter=FallbackCounter(), attention_mask=mask)
    assemble_routing(sorted(shard.routing, key=lambda r: r.sample_id), tokens, versions=7, attention_mask=mask)


def worker(rank: int, port: int, backend: str, a, out: str) -> None:
    from megatron_trace.guidance.sync import GuidanceSync

    try:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(0)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=90))
        dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        if a.shape == "disagg" and backend == "gloo":
            torch.set_num_threads(1)  # two ranks share the host's cores (as two_gpu_disagg --smoke does)
        dist.barrier()
        routing, tokens, mask = (), None, None
        if a.shape == "disagg":
            samples, routing, tokens, mask = make_disagg(a, "cuda" if cuda else "cpu")
        else:
            samples = make_samples(a, "cuda" if cuda else "cpu") if rank == 0 else None
        res = {"backend": backend, "rank": rank}
        for verify in (True, False):
            sync = GuidanceSync(0, [1], backend=backend, verify=verify, timeout=timedelta(seconds=120))
            got = {}
            fn = (lambda sync=sync: sync.send(samples, routing=routing)) if rank == 0 else (
                lambda sync=sync, got=got: got.update(s=sync.receive_shard()))
            res[f"sync_s_verify_{verify}"] = _timed(fn, dev, a.warmup, a.reps)
            if rank == 1:
                res["samples_received"] = got["s"].stats.samples
                if a.shape == "disagg" and verify:
                    res["assemble_s"] = _local_timed(lambda got=got: _trainer_assemble(got["s"], tokens, mask), dev,
                                                     a.reps)
        n = torch.zeros(1, dtype=torch.int64, device=dev)
        if rank == 0:
            msgs = sync.encode(samples, routing)
            n[0] = sum(m.numel() * m.element_size() for m in msgs)  # size message + header + payload, as sent
        dist.broadcast(n, src=0)
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
        fn = (lambda: dist.send(buf, 1)) if rank == 0 else (lambda: dist.recv(buf, 0))
        res["raw_s"] = _timed(fn, dev, a.warmup, a.reps)
        res["bytes"] = int(n.item())
        with open(out + f".rank{rank}", "w") as f:
            json.dump(res, f)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        with open(out + f".err{rank}", "w") as f:
            f.write(traceback.format_exc())


def run_pair(backend: str, a, tmp: str, join_s: float) -> dict:
    from benchmarks._megatron import free_port
    from megatron_trace.testing.megatron_cpu import spawn_ranks

    out = os.path.join(tmp, f"sync_{backend}.json")
    port = free_port()
    codes = spawn_ranks(worker, 2, lambda r: (r, port, backend, a, out), timeout=join_s)
    if all(os.path.exists(out + f".rank{r}") for r in range(2)):
        ranks = [json.load(open(out + f".rank{r}")) for r in range(2)]
        res = {k: v for k, v in ranks[1].items() if k != "rank"}  # the receiver's view, as before
        for k in ("sync_s_verify_True", "sync_s_verify_False", "raw_s"):
            res["send_" + k] = ranks[0][k]
        return res
    errs = [open(out + f".err{r}").read()[-600:] for r in range(2) if os.path.exists(out + f".err{r}")]
    return {"backend": backend, "error": errs or [f"exit codes {codes}"]}


def host_offload(a) -> dict:
    """GuidanceCache.put (device staging + async copy to freshly pinned host memory) vs a plain pinned copy."""
    from megatron_trace.guidance.cache import GuidanceCache

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    samples = make_samples(a, dev)
    cache = GuidanceCache(budget_bytes=1 << 40)
    ids = [s.sample_id for s in samples]
    put, get = [], []
    for i in range(a.warmup + a.reps):
        _sync(dev)
        t0 = time.perf_counter()
        cache.put(i, samples)
        cache.get(i, ids[:1])  # waits for the step's copy event
        t1 = time.perf_counter()
        got = cache.get(i, ids)  # every sample: views of the step's host buffer
        t2 = time.perf_counter()
        if i >= a.warmup:
            put.append(t1 - t0)
            get.append(t2 - t1)
        nbytes = cache.host_bytes
        del got
        cache.drop(i)
    res = {"bytes": nbytes, "put_s": statistics.median(put), "get_all_s": statistics.median(get)}
    res["put_GBps"] = nbytes / res["put_s"] / 1e9
    if not cuda:  # baselines: one plain copy of the same bytes into a fresh / an already-touched host buffer
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        for name, fn in (("fresh", lambda: torch.empty(nbytes, dtype=torch.uint8).copy_(src)),
                         ("reused", lambda: dst.copy_(src))):
            cp = []
            for i in range(a.warmup + a.reps):
                t0 = time.perf_counter()
                fn()
                if i >= a.warmup:
                    cp.append(time.perf_counter() - t0)
            res[f"plain_copy_{name}_GBps"] = nbytes / statistics.median(cp) / 1e9
            res[f"put_vs_plain_copy_{name}"] = res["put_GBps"] / res[f"plain_copy_{name}_GBps"]
    if cuda:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        t0 = time.perf_counter()
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        res["pinned_alloc_s"] = time.perf_counter() - t0
        ms = []
        for i in range(2 + 5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            pinned.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            if i >= 2:
                ms.append(s.elapsed_time(e))
        res["pinned_copy_GBps"] = nbytes / (statistics.median(ms) * 1e-3) / 1e9
        res["put_vs_pinned_copy"] = res["put_GBps"] / res["pinned_copy_GBps"]
    return res


def main():
    a = args_()
    import tempfile

    tmp = tempfile.mkdtemp(prefix="bench_sync_")
    cuda = torch.cuda.is_available()
    attempts = [run_pair("nccl", a, tmp, 60)] if cuda else []
    if not attempts or "error" in attempts[-1]:
        attempts.append(run_pair("gloo", a, tmp, 180))
    sync = attempts[-1]
    print(json.dumps(attempts), file=sys.stderr, flush=True)
    disagg = a.shape == "disagg"
    if "error" not in sync:
        for v in (True, False):
            sync[f"sync_GBps_verify_{v}"] = sync["bytes"] / sync[f"sync_s_verify_{v}"] / 1e9
            sync[f"ratio_sync_vs_raw_verify_{v}"] = sync["raw_s"] / sync[f"sync_s_verify_{v}"]
        sync["raw_GBps"] = sync["bytes"] / sync["raw_s"] / 1e9
    out = {
        "bench": "guidance_sync", "date": time.strftime("%Y-%m-%d"), "smoke": a.smoke, "cpu": a.cpu,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "shape": {k: getattr(a, k) for k in ("shape", "samples", "seq", "hidden", "layers", "ffn", "topk", "experts")
                  if hasattr(a, k)},
        "record": "compact nvfp4 FC1 + FC2 (expert ids) + routing" if disagg else "compact nvfp4 FC1",
        "sync": sync, "tried": [t["backend"] + (" failed: " + t["error"][0][-300:] if "error" in t else " ok")
                                for t in attempts],
    }
    if not disagg:
        out["host_offload"] = host_offload(a)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
