"""EP=2 lazy loading: a rank's peak memory during load follows its own shard, not the whole checkpoint.

What is measured: each worker resets its peak-RSS mark (``echo 5 > /proc/self/clear_refs``, Linux),
records VmRSS, runs ``load_hf_checkpoint`` and reads VmHWM; the growth is VmHWM - VmRSS, i.e. the
extra resident memory (anonymous + file-backed) at the load's peak, on top of the already built
model. The checkpoint (~200 MB fp32) is dominated by expert tensors, so a rank that read every
expert would grow by at least the whole expert total E; a rank that reads its half grows by about
E/2 + the non-expert bytes with ``memory_efficient=False`` (the rank's shard is held at once), and
by a few tensors with ``memory_efficient=True`` (one HF tensor at a time).
"""

import os

import pytest
import torch
from safetensors import safe_open

from .._rss import peak_growth
from ..rollout._tiny import save_tiny_checkpoint, tiny_config
from ._megatron_cpu import free_port, spawn_ranks

WORLD = 2
SLACK = 16 * 2**20  # allocator rounding, the fused gate/up copy of one expert, interpreter noise
# 2 layers x 64 experts x 3 x [512, 256] fp32 = 201 MB of experts; everything else is < 2 MB
BIG = dict(hidden_size=256, moe_intermediate_size=512, num_experts=64, num_hidden_layers=2)


def _worker(rank: int, port: int, ckpt: str, out: str) -> None:
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    from ._megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    torch.set_num_threads(1)
    apply_cpu_shims()
    init_megatron(rank, WORLD, port, ep=WORLD)
    try:
        bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
        model = bridge.build_model().eval()
        growth = {me: peak_growth(lambda me=me: load_hf_checkpoint(model, ckpt, bridge, memory_efficient=me))
                  for me in (False, True)}
        torch.save({"growth": growth, "read_bytes": bridge.last_load_stats.bytes}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        shutdown_megatron()


def _disk_bytes(ckpt: str) -> tuple[int, int]:
    """(expert bytes, non-expert bytes) of the checkpoint on disk."""
    experts = other = 0
    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            n = torch.Size(t.get_shape()).numel() * 4  # fp32 checkpoint
            if ".experts." in name:
                experts += n
            else:
                other += n
    return experts, other


@pytest.fixture(scope="module")
def memory_results(tmp_path_factory):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"peak-RSS reset (/proc/self/clear_refs) unavailable: {e}")
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("mem") / "hf", tiny_config(**BIG), seed=3)
    out = str(tmp_path_factory.mktemp("mem_out"))
    port = free_port()
    codes = spawn_ranks(_worker, WORLD, lambda r: (r, port, ckpt, out), timeout=240)
    assert codes == [0] * WORLD, "an EP worker failed (see its stderr above)"
    return _disk_bytes(ckpt), [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(WORLD)]


def test_peak_load_memory_follows_the_rank_shard(memory_results):
    (experts, other), results = memory_results
    assert experts > 50 * other  # the experts dominate, so the bound below discriminates
    shard = experts // WORLD + other
    assert shard + SLACK < experts  # a rank that materialised every expert could not pass
    for r in results:
        assert r["read_bytes"] == shard  # the last (memory-efficient) load read exactly the shard
        held = r["growth"][False]  # whole shard held at once
        assert 0.9 * experts / WORLD <= held <= shard + SLACK  # lower bound: the measurement sees the load
        assert r["growth"][True] <= SLACK  # one tensor at a time
