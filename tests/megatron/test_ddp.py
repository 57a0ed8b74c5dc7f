"""Megatron's DDP with the distributed optimizer (gloo; data parallel 2 at EP 1 and EP 2): with
``overlap_param_gather`` Megatron all-gathers a module's parameters in that module's forward pre-hook, and the
torch experts read their linears' weights without calling them. They run those pre-hooks first, so training with
the overlap gives the same parameters and logits, bit for bit, as without it."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import trace_spec
from megatron_trace.testing.megatron_cpu import spawn_ranks

from ._ddp import ddp_worker
from .harness import build_model, ep_state_dict, free_port, stock_spec, tiny_config

pytestmark = [pytest.mark.usefixtures("world1"), pytest.mark.slow]

FP32 = dict(params_dtype=torch.float32, bf16=False, pipeline_dtype=torch.float32)
BUCKET = 40_000  # elements: about a dozen buckets, so a layer's experts and its other modules lie in different ones


def _train(workdir, world: int, ep: int) -> list[dict]:
    port = free_port()
    codes = spawn_ranks(ddp_worker, world, lambda r: (r, world, ep, port, BUCKET, str(workdir)), timeout=240)
    msgs = [e.read_text() for e in (workdir / f"error{r}.txt" for r in range(world)) if e.exists()]
    assert not msgs and codes == [0] * world, msgs or codes
    return [torch.load(workdir / f"ep{ep}_rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("ep", [1, 2])
def test_overlap_param_gather_trains_the_torch_experts_as_without_it(tmp_path, ep):
    """EP 2 (4 ranks) puts the experts' weights in Megatron's expert-parallel buffers, whose all-gathers only the
    experts' own linears start and wait for."""
    world = 2 * ep
    cfg, tc = tiny_config(**FP32), TraceConfig()
    init = build_model(cfg, trace_spec(stock_spec(cfg), tc)).state_dict()
    torch.save({"config": FP32, "trace_config": tc, "state_dict": init}, tmp_path / "shared.pt")
    ranks = _train(tmp_path, world, ep)
    plain, overlapped = [r[False] for r in ranks], [r[True] for r in ranks]
    for rank in range(world):
        assert torch.equal(overlapped[rank]["logits"], plain[rank]["logits"]), rank
        for name, want in plain[rank]["params"].items():
            assert torch.equal(overlapped[rank]["params"][name], want), (rank, name)
    experts = [n for n in plain[0]["params"] if ".local_experts." in n]
    local = ep_state_dict(init, ranks[0]["ep_rank"], ep)
    assert experts and all(not torch.equal(plain[0]["params"][n], local[n]) for n in experts)  # they trained
    twin = next(r for r in range(1, world) if ranks[r]["ep_rank"] == ranks[0]["ep_rank"])
    for name, value in plain[0]["params"].items():  # one model on the data-parallel ranks
        assert torch.equal(plain[twin]["params"][name], value), name
