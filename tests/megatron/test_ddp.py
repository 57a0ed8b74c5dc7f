"""Megatron's DDP with the distributed optimizer (2 processes, gloo, data parallel 2): with
``overlap_param_gather`` Megatron all-gathers a module's parameters in that module's forward pre-hook, and the
torch experts read their linears' weights without calling them. They run those pre-hooks first, so training with
the overlap gives the same parameters and logits, bit for bit, as without it."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import trace_spec
from megatron_trace.testing.megatron_cpu import spawn_ranks

from ._ddp import ddp_worker
from .harness import build_model, free_port, stock_spec, tiny_config

pytestmark = [pytest.mark.usefixtures("world1"), pytest.mark.slow]

WORLD = 2
FP32 = dict(params_dtype=torch.float32, bf16=False, pipeline_dtype=torch.float32)
BUCKET = 40_000  # elements: about a dozen buckets, so a layer's experts and its other modules lie in different ones


def _train(workdir, overlap: bool) -> list[dict]:
    port = free_port()
    codes = spawn_ranks(ddp_worker, WORLD, lambda r: (r, WORLD, port, overlap, BUCKET, str(workdir)), timeout=240)
    msgs = [e.read_text() for e in (workdir / f"error{r}.txt" for r in range(WORLD)) if e.exists()]
    assert not msgs and codes == [0] * WORLD, msgs or codes
    return [torch.load(workdir / f"rank{r}_overlap{int(overlap)}.pt", weights_only=False) for r in range(WORLD)]


def test_overlap_param_gather_trains_the_torch_experts_as_without_it(tmp_path):
    cfg, tc = tiny_config(**FP32), TraceConfig()
    init = build_model(cfg, trace_spec(stock_spec(cfg), tc)).state_dict()
    torch.save({"config": FP32, "trace_config": tc, "state_dict": init}, tmp_path / "shared.pt")
    plain, overlapped = _train(tmp_path, False), _train(tmp_path, True)
    for rank in range(WORLD):
        assert torch.equal(overlapped[rank]["logits"], plain[rank]["logits"]), rank
        for name, want in plain[rank]["params"].items():
            assert torch.equal(overlapped[rank]["params"][name], want), (rank, name)
    experts = [n for n in plain[0]["params"] if ".local_experts." in n]
    assert experts and all(not torch.equal(plain[0]["params"][n], init[n]) for n in experts)  # they trained
    for name, value in plain[0]["params"].items():  # one model on both data-parallel ranks
        assert torch.equal(plain[1]["params"][name], value), name
