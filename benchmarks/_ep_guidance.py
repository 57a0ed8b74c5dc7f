"""The guidance path of benchmarks/ep_scaling.py: rollout record -> ``GuidanceSync`` ring -> ``GuidanceCache`` ->
``assemble`` (each rank's shard arrives from the previous rank, one link at a time, timed against a raw send)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def _sync_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout_samples(a, model, trace, ep, device, data_of, rank, world, batch):
    """Rank r's rollout copy records rank (r + 1) % world's tokens: per-sample guidance (guided layers) and routing."""
    from benchmarks._megatron import perturb_non_experts
    from benchmarks.two_gpu_ep import build
    from megatron_trace.guidance.records import split_batch
    from megatron_trace.guidance.routing import split_routing
    from megatron_trace.guidance.selection import guided_layers
    from megatron_trace.megatron import trace_record

    rollout = build(a, ep, "alltoall", trace, device)
    rollout.load_state_dict(model.state_dict())
    perturb_non_experts(rollout, 0.01)
    dst = (rank + 1) % world
    tokens, pos, mask, _ = data_of(dst)
    with trace_record(rollout, compact=True) as h, torch.no_grad():
        rollout(tokens, pos, mask)
    rec = h.recorded()
    del rollout
    keep = set(guided_layers(trace, a.layers))
    sites = {k: v for k, v in rec.sites.items() if k[0] in keep}
    ids = [dst * batch + b for b in range(batch)]
    samples = split_batch(sites, tokens, version=0, sample_ids=ids)
    routing = split_routing(rec.routing, tokens, version=0, num_experts=a.experts, sample_ids=ids)
    return samples, routing, sorted(keep)


def timed(fn, device, reps: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(reps):
        dist.barrier()
        _sync_device(device)
        t0 = time.perf_counter()
        out = fn()
        _sync_device(device)
        times.append(time.perf_counter() - t0)
    return times, out


def transfer(syncs, samples, routing, rank, world, device, reps) -> tuple[dict, object]:
    """Each link i -> (i + 1) % world in turn (one link at a time); returns this rank's receive stats and shard."""
    out, shard = {}, None
    for i, sync in enumerate(syncs):
        res = link(sync, i, (i + 1) % world, samples, routing, rank, device, reps)
        if res is not None:
            out, shard = res
    return out, shard


def link(sync, src, dst, samples, routing, rank, device, reps) -> tuple[dict, object] | None:
    """``reps`` guidance sends src -> dst over ``sync``, then raw sends of the same byte count on its group;
    the receiver returns (stats, its last shard), every other rank None."""
    if rank == src:
        fn = lambda: sync.send(samples, routing=routing)
    elif rank == dst:
        fn = sync.receive_shard
    else:
        fn = lambda: None
    times, res = timed(fn, device, reps)
    wire = [None]
    if rank == src:
        wire = [sum(m.numel() * m.element_size() for m in sync.encode(samples, routing))]
    dist.broadcast_object_list(wire, src=src)
    raw = torch.empty(wire[0], dtype=torch.uint8, device=sync.device)
    if rank == src:
        raw_fn = lambda: dist.send(raw, dst, group=sync.group)
    elif rank == dst:
        raw_fn = lambda: dist.recv(raw, src, group=sync.group)
    else:
        raw_fn = lambda: None
    raw_times, _ = timed(raw_fn, device, reps)
    if rank != dst:
        return None
    t, tr = statistics.median(times[1:] or times), statistics.median(raw_times[1:] or raw_times)
    return {"sync_payload_bytes": res.stats.payload_bytes, "sync_wire_bytes": wire[0], "sync_first_s": times[0],
            "sync_s": t, "sync_GBps": wire[0] / t / 1e9, "raw_send_s": tr, "raw_send_GBps": wire[0] / tr / 1e9,
            "sync_chunks": res.stats.chunks, "sync_peak_bytes": res.stats.peak_bytes}, res


def trainer_guidance(samples, routing, data, trace):
    """Through a GuidanceCache (host memory) into a StepGuidance; returns it, the cache stats, assemble ms."""
    from megatron_trace.guidance.cache import GuidanceCache
    from megatron_trace.guidance.records import assemble
    from megatron_trace.guidance.routing import assemble_routing
    from megatron_trace.guidance.site import FallbackCounter
    from megatron_trace.megatron import StepGuidance

    cache = GuidanceCache.from_config(trace)
    cache.put(0, samples)
    tokens = data[0]
    t0 = time.perf_counter()
    got = cache.get(0, sorted(s.sample_id for s in samples))
    counter = FallbackCounter()
    sites = assemble(got, tokens, versions=0, counter=counter)
    routes = assemble_routing(sorted(routing, key=lambda r: r.sample_id), tokens, versions=0)
    _sync_device(tokens.device)
    ms = (time.perf_counter() - t0) * 1e3
    return StepGuidance(sites=sites, routing=routes), cache, ms, counter
