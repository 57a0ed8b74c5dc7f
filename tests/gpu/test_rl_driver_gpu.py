"""The RL driver's trainer step on CUDA (NCCL world of 1): Megatron's ``forward_backward_func`` over 4 micro-batches,
each with its own routing and its own guidance assembled from the cache, under one ``trace_guidance`` context
(records copied to the GPU layer by layer), against one micro-batch; then a whole micro-batched GRPO step.
Measured differences go to ``$MEGATRON_TRACE_METRICS`` when set."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest

from ._common import DEVICE, metric

if DEVICE is None:
    pytest.skip("needs CUDA (or MEGATRON_TRACE_GPU_DRYRUN=1 for a CPU dry run)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

from megatron_trace.config import TraceConfig  # noqa: E402
from megatron_trace.rl.arms import make_arm  # noqa: E402
from megatron_trace.rl.driver import GRPORun, RLConfig  # noqa: E402
from megatron_trace.rl.sft import SFTConfig, TinyMoEConfig, sft_checkpoint  # noqa: E402
from megatron_trace.rl.tasks import get_task  # noqa: E402

from ..megatron.harness import destroy_parallel, free_port  # noqa: E402
from ..rl._passes import check_micro_batches_match_one  # noqa: E402

pytestmark = pytest.mark.gpu
MODEL = TinyMoEConfig(num_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      num_experts=8, top_k=2, moe_intermediate_size=64)
RL = RLConfig(steps=1, prompts_per_step=4, group_size=4, eval_problems=16, checkpoint_every=0, sentinel_prompts=2)
# on the GPU, GEMMs of 4 rows and of 16 could take different kernels (bf16 rounding, not wrong rows): 1e-3 of margin
TOL = dict(logp_atol=1e-5 if DEVICE == "cpu" else 1e-3, grad_rel=2**-7)  # measured on an H200: 0 and 0.003


def _metric(name: str, value) -> None:
    metric("rl_driver_gpu", name, value)


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    from megatron_trace.rl.demo import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_distributed(DEVICE)
    yield
    destroy_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ckpt(world, tmp_path_factory):
    return str(sft_checkpoint(tmp_path_factory.mktemp("sft"), get_task("add"), MODEL, SFTConfig(steps=5),
                              device=DEVICE))


@pytest.mark.parametrize("arm", ["bf16", "trace_full"])
def test_micro_batches_through_megatrons_schedule_match_one(ckpt, tmp_path, arm):
    r = GRPORun(make_arm(arm, TraceConfig()), RL, get_task("add"), ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c", device=DEVICE)
    for name, value in check_micro_batches_match_one(r, **TOL).items():
        _metric(f"{arm}/{name}", value)


def test_a_micro_batched_guided_step(ckpt, tmp_path):
    """A whole GRPO step of the compact deepest-half arm over 4 micro-batches (weights fake-quantized once for
    all), its sentinel and its FP4 weight sync."""
    cfg = dataclasses.replace(RL, micro_batch_size=4)
    r = GRPORun(make_arm("trace", TraceConfig()), cfg, get_task("add"), ckpt, out_dir=tmp_path,
                cache_dir=tmp_path / "c", device=DEVICE)
    m = r.step()
    assert m["trainer/micro_batches"] == 4.0 and m["guidance/trainer/coverage"] == 1.0, m
    for key in ("loss", "grad_norm", "mismatch/logprob_abs_diff", "sentinel/logprob_abs_diff"):
        assert math.isfinite(m[key]), key
    assert r.cache.steps == []
    _metric("trace/step_mismatch_logprob_abs_diff", m["mismatch/logprob_abs_diff"])
