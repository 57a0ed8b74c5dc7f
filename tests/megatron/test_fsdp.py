"""Sharded data parallelism around TRACE's experts (``megatron.sharding``).

torch FSDP2, as Megatron's ``TorchFullyShardedDataParallel`` applies it (gloo, data parallel 1 and 2): the layers'
pre-forward all-gather gives the experts their whole weights, so a recorded forward, a guided one, the gradients and
an Adam step equal the unwrapped model's, bit for bit. Refused by name: FSDP2 sharding the experts across expert-
parallel ranks (each rank's experts joined with another's), ``reuse_weight_quant`` under a sharded wrapper (the
weights are gathered anew every forward), and Megatron-FSDP (CUDA only: not verified here)."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import reuse_weight_quant, trace_config_from_args, trace_guidance, trace_spec
from megatron_trace.testing.megatron_cpu import spawn_ranks

from ._fsdp import fsdp2_worker
from .harness import build_model, free_port, stock_spec, tiny_config
from .test_args import parse
from .test_dist import _same_records

pytestmark = [pytest.mark.usefixtures("world1")]


def _spawn(tmp_path, world: int, ep: int) -> list[dict]:
    port = free_port()
    codes = spawn_ranks(fsdp2_worker, world, lambda r: (r, world, ep, port, str(tmp_path)), timeout=300)
    msgs = [e.read_text() for e in (tmp_path / f"error{r}.txt" for r in range(world)) if e.exists()]
    assert not msgs and codes == [0] * world, msgs or codes
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _same_forward(got: dict, want: dict) -> None:
    assert torch.equal(got["logits"], want["logits"])
    _same_records(got["recorded"], want["recorded"])
    assert got["counter"] == want["counter"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_forward_gradients_and_step_equal_the_unwrapped_model(tmp_path, world):
    for rank, out in enumerate(_spawn(tmp_path, world, ep=1)):
        assert out["sharded"] == "DTensor", rank  # (outside a forward: shards)
        for mode in ("plain", "guided", "after"):
            _same_forward(out[mode]["fsdp"], out[mode]["ref"])
        assert out["guided"]["ref"]["counter"] != out["plain"]["ref"]["counter"]  # (guidance was used)
        for name, (want, got) in out["grads"].items():
            assert torch.equal(got, want), (rank, name)
        experts = [n for n in out["params"] if ".local_experts." in n]
        assert sum(bool(out["grads"][n][0].abs().sum() > 0) for n in experts) > len(experts) // 2  # (trained)
        for name, (want, got) in out["params"].items():
            assert torch.equal(got, want), (rank, name)
        assert "reuse_weight_quant keeps the experts' fake-quantized weights" in out["reuse_error"], rank


@pytest.mark.slow
def test_fsdp2_sharding_the_experts_across_expert_parallel_ranks_is_refused(tmp_path):
    """EP 2 on 2 ranks: Megatron's wrapper shards over the data-parallel group (both ranks), whose ranks hold other
    experts; the forward would compute with rank 0's half of its experts joined to rank 1's half of its own."""
    for rank, out in enumerate(_spawn(tmp_path, 2, ep=2)):
        assert f"sharded (torch FSDP2) over ranks [{1 - rank}], which hold other experts" in out["error"], out


def _mark_as_megatron_fsdp(model) -> None:
    """What Megatron-FSDP sets on every parameter it manages (``MegatronFSDP._replace_param_with_distributed_if_
    needed``, ``all_gather_and_wait_parameters_ready``): it cannot be built on the CPU."""
    for p in model.parameters():
        p.__fsdp_param__ = True


def test_megatron_fsdp_parameters_are_refused_by_trace_guidance_and_reuse():
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig()))
    with trace_guidance(model, None):  # (find_trace_layers cached: the check runs on every call)
        pass
    _mark_as_megatron_fsdp(model)
    for scope in (trace_guidance, reuse_weight_quant):
        with pytest.raises(ValueError, match=r"the experts of layer 0: TRACE does not support Megatron-FSDP "
                                             r"\(--use-megatron-fsdp"):
            with scope(model):
                pass


@pytest.mark.parametrize("flags, model, message", [
    ([], dict(use_megatron_fsdp=True), r"--use-megatron-fsdp with --trace-fp4: TRACE does not support Megatron-FSDP"),
    ([], dict(use_custom_fsdp=True), r"--use-custom-fsdp with --trace-fp4: TRACE does not support Megatron-FSDP"),
    ([], dict(use_torch_fsdp2=True, expert_model_parallel_size=2),
     r"--use-torch-fsdp2 with --expert-model-parallel-size 2: .*use --expert-model-parallel-size 1 with it"),
    (["--trace-reuse-weight-quant"], dict(use_torch_fsdp2=True),
     r"--trace-reuse-weight-quant does not work with --use-torch-fsdp2: .*drop --trace-reuse-weight-quant or "
     r"--use-torch-fsdp2"),
], ids=["megatron_fsdp", "custom_fsdp", "fsdp2_ep2", "fsdp2_reuse"])
def test_sharded_data_parallel_flags_trace_refuses(flags, model, message):
    ns = parse(["--trace-fp4", *flags], num_experts=8, moe_enable_routing_replay=True, **model)
    with pytest.raises(ValueError, match=message):
        trace_config_from_args(ns)


def test_fsdp2_flags_trace_accepts():
    ns = parse(["--trace-fp4"], num_experts=8, moe_enable_routing_replay=True, use_torch_fsdp2=True,
               expert_model_parallel_size=1)
    assert trace_config_from_args(ns).enabled
    ns = parse(["--trace-fp4", "--trace-sites", "kv_k,kv_v"], num_experts=None, use_megatron_fsdp=True)
    assert trace_config_from_args(ns).enabled  # (a dense KV-only model: no experts read their weights)
