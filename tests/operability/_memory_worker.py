"""Worker processes of the side-data memory test (module level so torch.multiprocessing spawn can import them)."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trace.guidance.records import split_batch
from megatron_trace.guidance.routing import split_routing
from megatron_trace.guidance.sync import GuidanceSync, assign_destinations

from ..guidance._data import assert_samples_equal, make_batch

B, S, LAYERS, TOPK, EXPERTS = 16, 4096, 24, 8, 128  # ~64k tokens, 192 routing bytes per token
CHUNK = 1 << 20
SCENARIOS = ("chunked", "one_shot", "concentrated")


def side_data():
    """The same rollout batch in every process (seeded): guidance of one layer + routing of 24 layers."""
    batch, _, tokens, mask = make_batch(B=B, S=S, layers=(LAYERS - 1,), sites=("expert_fc1_in",), seed=3)
    g = torch.Generator().manual_seed(4)
    routing = {i: torch.randint(0, EXPERTS, (B, S, TOPK), generator=g) for i in range(LAYERS)}
    ids = list(range(100, 100 + B))
    samples = split_batch(batch, tokens, version=7, attention_mask=mask, sample_ids=ids)
    r = split_routing(routing, tokens, version=7, num_experts=EXPERTS, attention_mask=mask, sample_ids=ids)
    return samples, r, int(mask.sum())


def _plan(scenario: str, dsts):
    chunk = None if scenario == "one_shot" else CHUNK
    dest = (lambda sid: dsts[0]) if scenario == "concentrated" else None
    return chunk, dest


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    result = Path(outdir) / f"rank{rank}.json"
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        dsts = list(range(1, world))
        sync = GuidanceSync(0, dsts, timeout=timedelta(seconds=60))
        samples, routing, tokens = side_data()
        out = {"tokens": tokens, "total_bytes": sum(s.nbytes() for s in samples) + sum(r.nbytes() for r in routing),
               "max_sample_bytes": max(s.nbytes() + r.nbytes() for s, r in zip(samples, routing))}
        for scenario in SCENARIOS:
            chunk, dest = _plan(scenario, dsts)
            if rank == 0:
                sync.send(samples, dest, routing=routing, chunk_bytes=chunk)
            else:
                shard = sync.receive_shard()
                mine = {s.sample_id for s in assign_destinations(samples, dsts, dest)[rank]}
                want = [s for s in samples if s.sample_id in mine]
                assert [s.sample_id for s in shard.samples] == [s.sample_id for s in want]
                for a, b in zip(shard.samples, want):
                    assert_samples_equal(a, b)
                want_r = [r for r in routing if r.sample_id in mine]
                assert [r.sample_id for r in shard.routing] == [r.sample_id for r in want_r]
                for a, b in zip(shard.routing, want_r):
                    assert a.token_hash == b.token_hash and a.experts.keys() == b.experts.keys()
                    assert all(torch.equal(a.experts[k], b.experts[k]) for k in a.experts)
                out[f"{scenario}/shard_bytes"] = sum(s.nbytes() for s in want) + sum(r.nbytes() for r in want_r)
            out[scenario] = sync.last_stats.as_dict()
        result.write_text("OK" + json.dumps(out))
    except Exception:  # reported to the parent test
        result.write_text("FAIL\n" + traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
