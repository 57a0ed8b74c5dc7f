"""Expert-parallel scaling of a Megatron MoE with TRACE vs plain FP4 QAT: weak and strong scaling (issue 10).

    python3 benchmarks/ep_scaling.py --max-ep 2 --out ep.jsonl        # GPUs: EP=1, 2, each on world = EP (spawned)
    torchrun --nproc-per-node 8 benchmarks/ep_scaling.py --out ep.jsonl   # one point set at EP = WORLD_SIZE
    python3 benchmarks/ep_scaling.py --smoke --max-ep 2               # CPU, gloo, tiny sizes (the CPU test)
    bash benchmarks/device_ep_scaling.sh                              # device call (nvidia-h200-x2, carry .whl)

World = EP (TP = PP = 1): data parallel over all ranks, each rank owns experts / EP experts (alltoall
dispatcher). Weak scaling keeps ``--batch`` sequences per rank; strong scaling splits ``--global-batch``
sequences over the ranks. Per (EP, mode) two variants, each forward + backward + gradient all-reduce of the
dense parameters over the data-parallel group (one flat buffer; experts have expert-DP size 1) + AdamW:

  fp4_qat  the TRACE spec with the trainer's own RNE everywhere (plain FP4 QAT, no guidance, no replay);
  trace    guided: compact records of the deepest half of the layers and routing replay. The guidance comes from
           a "rollout" copy with perturbed non-expert weights: rank r records the tokens of rank (r + 1) % EP and
           sends them over the real ``GuidanceSync`` (NCCL on GPU, gloo on CPU); the receiver puts its shard in a
           ``GuidanceCache`` (host memory), gets it back and assembles it (``assemble``/``assemble_routing``).
           At EP = 1 the rollout is colocated: no transfer (sync fields null). (benchmarks/_ep_guidance.py)

Per point (one JSON line, appended to ``--out``): median step ms (CUDA events after warm-up; max over ranks),
tokens/s, TRACE overhead vs FP4 QAT, guidance bytes / sync payload / routing bytes per rank (each equal to
``guidance.planner.shard_bytes`` for this config: checked, exit 1 otherwise), sync time and GB/s vs a raw send
of the same bytes, guidance cache host bytes per rank, assemble ms. Plot and table: benchmarks/plot_ep_scaling.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
for _k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):  # multicast stays off
    os.environ[_k] = "0" if _k == "NCCL_NVLS_ENABLE" else "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._ranks import emit, gather, record_errors, write_result  # noqa: E402
from benchmarks._timing import step_median_ms  # noqa: E402

DEFAULTS = dict(layers=8, hidden=1024, experts=64, topk=4, moe_ffn=512, heads=16, groups=4, vocab=32768, seq=1024,
                batch=8, global_batch=8, warmup=3, reps=10, sync_reps=5)
SMOKE = dict(layers=4, hidden=64, experts=8, topk=2, moe_ffn=32, heads=4, groups=2, vocab=128, seq=16, batch=2,
             global_batch=2, warmup=1, reps=2, sync_reps=2)


def args_(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v} (smoke {SMOKE[k]})")
    p.add_argument("--max-ep", type=int, default=2, help="spawn EP = 1, 2, 4, ... up to this (world = EP)")
    p.add_argument("--eps", default=None, help="comma list of EP sizes instead of --max-ep")
    p.add_argument("--modes", default="weak,strong")
    p.add_argument("--kernel", default="auto", help="TraceConfig.kernel")
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny sizes")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--timeout", type=float, default=220.0, help="seconds per spawned world")
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    bad = [m for m in a.modes.split(",") if m not in MODES]
    if bad or not a.modes:
        p.error(f"--modes {a.modes!r}: each mode must be one of {MODES}")
    try:
        ep_sizes(a)
    except ValueError as e:
        p.error(str(e))
    return a


MODES = ("weak", "strong")


def ep_sizes(a) -> list[int]:
    if a.eps:
        try:
            out = [int(e) for e in a.eps.split(",")]
        except ValueError:
            out = []
    else:
        out, e = [], 1
        while e <= a.max_ep:
            out.append(e)
            e *= 2
    if not out or min(out) < 1:
        raise ValueError(f"--eps {a.eps!r} / --max-ep {a.max_ep}: EP sizes must be ints >= 1 (at least one)")
    return out


def check_sizes(a, ep: int) -> None:
    if a.experts % ep:
        raise ValueError(f"--experts {a.experts} must be a multiple of EP={ep}")
    if "strong" in a.modes.split(",") and a.global_batch % ep:
        raise ValueError(f"--global-batch {a.global_batch} must be a multiple of EP={ep} (strong scaling)")


# ---- model, data, step ---------------------------------------------------------------------------------------
def build(a, ep: int, trace, device):
    from benchmarks.two_gpu_ep import build as build_gpt

    return build_gpt(a, ep, "alltoall", trace, device)


def planner_dims(a):
    from megatron_trace.guidance.model_dims import ModelDims

    return ModelDims(num_layers=a.layers, hidden=a.hidden, moe_ffn=a.moe_ffn, topk=a.topk, kv_heads=a.groups,
                     head_dim=a.hidden // a.heads, moe_layers=tuple(range(a.layers)),
                     kv_layers=tuple(range(a.layers)), num_experts=a.experts, name="ep_scaling")


def reduce_dense_grads(model, group) -> None:
    """Average the data-parallel parameters' gradients over ``group`` in one flat buffer (Megatron marks expert
    parameters ``allreduce=False``: their expert-DP group is this rank alone when world = EP)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "allreduce", True)]
    n = dist.get_world_size(group)
    if n == 1 or not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(n)
    for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(r)


def step_fn(model, data, group, guidance=None, last=None):
    """One training step; ``guidance``: a StepGuidance template (a fresh counter each step)."""
    from megatron_trace.megatron import StepGuidance, trace_guidance

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=data[0].is_cuda)
    tokens, pos, mask, labels = data

    def step():
        opt.zero_grad(set_to_none=True)
        if guidance is None:  # plain FP4 QAT: the spec's own rounding, no guidance context at all
            loss = model(tokens, pos, mask, labels=labels).float().mean()
            loss.backward()
            h = None
        else:
            with trace_guidance(model, StepGuidance(sites=guidance.sites, routing=guidance.routing)) as h:
                loss = model(tokens, pos, mask, labels=labels).float().mean()
                loss.backward()
        reduce_dense_grads(model, group)
        opt.step()
        if last is not None:
            last["loss"] = float(loss.detach())
            if h is not None:
                last.update(coverage=h.coverage(), used=h.counter.used, fallback=dict(h.counter.fallback))

    return step


# ---- one point ---------------------------------------------------------------------------------------------------
def run_mode(a, mode, ep, rank, world, device, group, syncs, fails) -> dict:
    from benchmarks._ep_guidance import rollout_samples, trainer_guidance, transfer
    from benchmarks._megatron import lm_batch
    from megatron_trace.config import TraceConfig
    from megatron_trace.guidance.planner import shard_bytes
    from megatron_trace.megatron.step import NOT_GUIDED

    batch = a.batch if mode == "weak" else a.global_batch // world
    s = SimpleNamespace(**{**vars(a), "batch": batch})
    data_of = lambda r: lm_batch(s, str(device), seed=1000 + r)  # noqa: E731  rank r's sequences
    data = data_of(rank)
    res = {}
    qat = TraceConfig(kernel=a.kernel)
    trace = TraceConfig(kernel=a.kernel, guided_layers="fraction", guided_fraction=0.5, cache_mode="compact",
                        routing_replay=True)
    model = build(s, ep, qat, device)
    local = [n for n, p in model.named_parameters() if not getattr(p, "allreduce", True)]
    if ep > 1 and (not local or any(".experts." not in n for n in local)):
        fails.append(f"EP={ep}: parameters kept out of the dense all-reduce should be the experts: {local[:4]}")
    res["dense_grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()
                                  if getattr(p, "allreduce", True))
    last = {}
    res["fp4_qat_ms"] = step_median_ms(step_fn(model, data, group, last=last), device, a.warmup, a.reps)
    res["fp4_qat_loss"] = last["loss"]
    del model
    model = build(s, ep, trace, device)
    samples, routing, layers = rollout_samples(s, model, trace, ep, device, data_of, rank, world, batch)
    sync = {}
    if world > 1:
        sync, shard = transfer(syncs, samples, routing, rank, world, device, a.sync_reps)
        samples, routing = shard.samples, shard.routing
    guidance, cache, asm_ms, counter = trainer_guidance(samples, routing, data, trace)
    res["trace_ms"] = step_median_ms(step_fn(model, data, group, guidance, last), device, a.warmup, a.reps)
    del model, guidance
    if device.type == "cuda":
        torch.cuda.empty_cache()
    want = shard_bytes(planner_dims(a), trace, [a.seq] * batch, layers=layers)
    got = {"guidance": sum(x.guidance_nbytes() for x in samples), "flat": cache.peak_host_bytes,
           "routing": sum(r.nbytes() for r in routing), "sync_payload": sync.get("sync_payload_bytes")}
    res.update(trace_loss=last["loss"], guided_coverage=last["coverage"], guided_rows_used=last["used"],
               trainer_fallback=last["fallback"], assembly_fallback=dict(counter.fallback), assemble_ms=asm_ms,
               guided_layers=layers, guidance_bytes=got["guidance"], cache_host_bytes=got["flat"],
               routing_bytes=got["routing"], planner=want, **sync)
    mism = {k: (v, want[k]) for k, v in got.items() if v is not None and v != want[k]}
    where = f"EP={ep} {mode} rank {rank}"
    if mism:
        fails.append(f"{where}: measured bytes != planner.shard_bytes: {mism}")
    real_fallback = {k: v for k, v in last["fallback"].items() if k != NOT_GUIDED}  # unguided layers: by policy
    if real_fallback or counter.fallback or last["coverage"] < 1.0:
        fails.append(f"{where}: guidance not fully used: coverage {last['coverage']}, fallback {last['fallback']}, "
                     f"assembly {dict(counter.fallback)}")
    if not all(map(_finite, (res["fp4_qat_loss"], res["trace_loss"]))):
        fails.append(f"{where}: loss not finite")
    return res


def _finite(x) -> bool:
    return isinstance(x, int | float) and x == x and abs(x) != float("inf")


def point_row(a, mode, ep, per_rank: list[dict], device) -> dict:
    """One JSON line from every rank's results (times: max over ranks; bytes: per rank, max)."""
    batch = a.batch if mode == "weak" else a.global_batch // ep
    qat = max(r["fp4_qat_ms"] for r in per_rank)
    trace = max(r["trace_ms"] for r in per_rank)
    tokens = ep * batch * a.seq
    r0 = per_rank[0]
    row = {"bench": "ep_scaling", "mode": mode, "ep": ep, "world": ep, "smoke": a.smoke,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "kernel": a.kernel,
           "shape": {k: getattr(a, k) for k in ("layers", "hidden", "experts", "topk", "moe_ffn", "heads", "groups",
                                                "vocab", "seq")},
           "batch_per_rank": batch, "tokens_per_rank": batch * a.seq, "tokens_per_step": tokens,
           "warmup": a.warmup, "reps": a.reps, "guided_layers": r0["guided_layers"],
           "dense_allreduce_bytes": r0["dense_grad_bytes"] if ep > 1 else 0,
           "fp4_qat_step_ms": qat, "trace_step_ms": trace,
           "fp4_qat_tokens_per_s": tokens / (qat / 1e3), "trace_tokens_per_s": tokens / (trace / 1e3),
           "trace_overhead": trace / qat - 1.0,
           "guidance_bytes_per_rank": max(r["guidance_bytes"] for r in per_rank),
           "routing_bytes_per_rank": max(r["routing_bytes"] for r in per_rank),
           "cache_host_bytes_per_rank": max(r["cache_host_bytes"] for r in per_rank),
           "planner": r0["planner"], "assemble_ms": max(r["assemble_ms"] for r in per_rank),
           "guided_coverage": min(r["guided_coverage"] for r in per_rank),
           "loss": {"fp4_qat": r0["fp4_qat_loss"], "trace": r0["trace_loss"]}}
    row["bytes_match_planner"] = all(
        r["guidance_bytes"] == r["planner"]["guidance"] and r["cache_host_bytes"] == r["planner"]["flat"]
        and r["routing_bytes"] == r["planner"]["routing"]
        and r.get("sync_payload_bytes", r["planner"]["sync_payload"]) == r["planner"]["sync_payload"]
        for r in per_rank)
    if ep > 1:
        row.update({"sync": "ring over GuidanceSync",
                    "sync_payload_bytes_per_rank": max(r["sync_payload_bytes"] for r in per_rank),
                    "sync_wire_bytes_per_rank": max(r["sync_wire_bytes"] for r in per_rank),
                    "sync_s": max(r["sync_s"] for r in per_rank),
                    "sync_first_s": max(r["sync_first_s"] for r in per_rank),
                    "sync_GBps": min(r["sync_GBps"] for r in per_rank),
                    "raw_send_s": max(r["raw_send_s"] for r in per_rank),
                    "raw_send_GBps": min(r["raw_send_GBps"] for r in per_rank)})
        row["sync_vs_raw"] = row["raw_send_s"] / row["sync_s"]
        # the planner's payload at the measured raw bandwidth: the time the projection would predict
        row["planner_sync_s_at_raw_GBps"] = r0["planner"]["sync_payload"] / (row["raw_send_GBps"] * 1e9)
        row["sync_fraction_of_trace_step"] = row["sync_s"] / (trace / 1e3)
    else:
        row.update({"sync": "colocated (world 1): no transfer", "sync_payload_bytes_per_rank": None, "sync_s": None,
                    "sync_GBps": None, "raw_send_GBps": None})
    return row


# ---- processes ---------------------------------------------------------------------------------------------------
def run_world(a, ep: int, rank: int, world: int) -> tuple[list[dict], list[str]]:
    """Everything one rank does for EP = world; rank 0 returns the point rows."""
    from megatron.core import parallel_state

    from benchmarks.two_gpu_ep import destroy_parallel, init_parallel
    from megatron_trace.guidance.sync import GuidanceSync

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not a.smoke \
        else torch.device("cpu")
    init_parallel(ep)
    group = parallel_state.get_data_parallel_group()
    syncs = [GuidanceSync(i, [(i + 1) % world], timeout=timedelta(seconds=a.timeout)) for i in range(world)] \
        if world > 1 else []
    fails, rows = [], []
    done = {}  # per-rank batch -> results: at EP = 1 weak and strong scaling may be the same run
    for mode in a.modes.split(","):
        batch = a.batch if mode == "weak" else a.global_batch // world
        if batch not in done:
            done[batch] = run_mode(a, mode, ep, rank, world, device, group, syncs, fails)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, done[batch])
        if rank == 0:
            rows.append(point_row(a, mode, ep, per_rank, device))
    all_fails = [None] * world
    dist.all_gather_object(all_fails, fails)
    for s in syncs:
        s.close()
    destroy_parallel()
    return rows, [f for fs in all_fails for f in fs] if rank == 0 else []


def init_process(a, rank: int, world: int) -> None:
    if a.smoke:
        from megatron_trace.testing.megatron_cpu import apply_cpu_shims

        torch.set_num_threads(1)
        apply_cpu_shims()
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.timeout))
    else:
        from megatron_trace.testing.megatron_cpu import fix_router_without_te

        fix_router_without_te()
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local),
                                timeout=timedelta(seconds=a.timeout))


def worker(rank: int, world: int, port: int, a, tmp: str) -> None:
    with record_errors(tmp, rank):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_process(a, rank, world)
        rows, fails = run_world(a, world, rank, world)
        write_result(tmp, rank, rows, fails)
        dist.barrier()
        dist.destroy_process_group()


def spawn_world(a, ep: int) -> tuple[list[dict], list[str]]:
    """EP = world = ``ep`` in spawned processes: the point rows (with the world's wall time) and the fails."""
    from megatron_trace.testing.megatron_cpu import free_port, spawn_ranks

    t0, port = time.perf_counter(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        codes = spawn_ranks(worker, ep, lambda r: (r, ep, port, a, tmp), timeout=a.timeout)
        rows, fails = gather(tmp, ep, codes)
    for row in rows:
        row["world_wall_s"] = time.perf_counter() - t0
    return rows, fails


def main(argv=None) -> int:
    a = args_(argv)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun: this process is one rank of EP = WORLD_SIZE
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        check_sizes(a, world)
        init_process(a, rank, world)
        rows, fails = run_world(a, world, rank, world)
        dist.destroy_process_group()
        if rank == 0:
            emit(rows + [{"bench": "ep_scaling", "summary": True, "ok": not fails, "fails": fails}], a.out)
        return 0 if not fails else 1
    eps = ep_sizes(a)
    for ep in eps:
        check_sizes(a, ep)
    if not a.smoke and torch.cuda.device_count() < max(eps):
        print(json.dumps({"bench": "ep_scaling", "skipped": f"needs {max(eps)} CUDA devices (or --smoke)"}))
        return 0
    rows, fails = [], []
    for ep in eps:
        r, f = spawn_world(a, ep)
        emit(r, a.out)
        rows, fails = rows + r, fails + f
    emit([{"bench": "ep_scaling", "summary": True, "ok": not fails, "fails": fails, "eps": eps}], a.out)
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
