"""EP=2 on two CPU processes (gloo, alltoall dispatcher): lazy per-rank loading, logits, export."""

import os

import pytest
import torch
from safetensors import safe_open

from ..rollout._tiny import save_tiny_checkpoint, tiny_config
from ._megatron_cpu import free_port, spawn_ranks

WORLD = 2
TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _disk(path):
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _worker(rank: int, port: int, ckpt: str, out: str) -> None:
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, export_hf_weights, load_hf_checkpoint
    from megatron_trace.rollout.hf_weights import parse_expert_name

    from ._megatron_cpu import apply_cpu_shims, init_megatron, megatron_logits, shutdown_megatron

    torch.set_num_threads(1)
    apply_cpu_shims()
    init_megatron(rank, WORLD, port, ep=WORLD)
    try:
        bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
        model = bridge.build_model().eval()
        stats = load_hf_checkpoint(model, ckpt, bridge)
        disk = _disk(ckpt)
        per_rank = bridge.config.num_moe_experts // WORLD
        mine = {n for n in disk if (p := parse_expert_name(n)) is None or p[1] // per_rank == rank}
        exported = {n: t.clone() for n, t in export_hf_weights(model, bridge)}
        torch.save({
            "bytes": stats.bytes,
            "expected_bytes": sum(disk[n].numel() * disk[n].element_size() for n in mine),
            "expert_bytes": sum(disk[n].numel() * disk[n].element_size() for n in mine if parse_expert_name(n)),
            "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
            "local_hf_names_are_mine": set(bridge.local_hf_names(model)) == mine,
            "config_ep": bridge.config.expert_model_parallel_size,
            "logits": megatron_logits(model, TOKENS),
            "export_exact": exported.keys() == disk.keys() and all(torch.equal(exported[k], disk[k]) for k in disk),
        }, os.path.join(out, f"rank{rank}.pt"))
    finally:
        shutdown_megatron()


@pytest.fixture(scope="module")
def ep2_results(tmp_path_factory):
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("ep2") / "hf", tiny_config(), seed=5)
    out = str(tmp_path_factory.mktemp("ep2_out"))
    port = free_port()
    codes = spawn_ranks(_worker, WORLD, lambda r: (r, port, ckpt, out), timeout=240)
    assert codes == [0] * WORLD, "an EP worker failed (see its stderr above)"
    return ckpt, [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(WORLD)]


def test_each_rank_reads_only_its_shard(ep2_results):
    ckpt, results = ep2_results
    disk = _disk(ckpt)
    all_experts = sum(t.numel() * t.element_size() for n, t in disk.items() if ".experts." in n)
    for r in results:
        assert r["local_experts"] == 4
        assert r["bytes"] == r["expected_bytes"]
        assert r["expert_bytes"] == all_experts // WORLD
        assert r["local_hf_names_are_mine"]  # under global expert ids: rank 1's are experts 4..7
        assert r["config_ep"] == WORLD


def test_ep2_logits_equal_transformers(ep2_results):
    from transformers import AutoModelForCausalLM

    ckpt, results = ep2_results
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(TOKENS).logits
    for r in results:
        assert (r["logits"] - ref).abs().max() < 1e-4 * ref.abs().max()


def test_ep2_export_gathers_all_experts_bit_exact(ep2_results):
    _, results = ep2_results
    assert all(r["export_exact"] for r in results)
