"""The export right after an optimizer step under Megatron's DDP with the distributed optimizer and
``overlap_param_gather`` (two gloo ranks): the step updates each rank's shard and the all-gather of the others waits
for the next forward's pre-hooks, so the export gathers them first; it yields the weights the next forward uses, the
same on every rank. An export between the gradient sync and the step leaves the next forward's all-gather to it.
Under torch FSDP2 the parameters are DTensor shards outside a forward: the export gathers them whole."""

import os

import pytest
import torch
from safetensors import safe_open

from ..rollout._tiny import save_tiny_checkpoint
from ._megatron_cpu import free_port, spawn_ranks

pytestmark = pytest.mark.slow

WORLD = 2
SEQ = 16


def _worker(rank: int, port: int, ckpt: str, out: str) -> None:
    from megatron_trace.testing.megatron_cpu import record_errors

    with record_errors(out, rank):
        _run(rank, port, ckpt, out)


def _loaded(rank: int, port: int, ckpt: str):
    """(bridge, model) of this rank: Megatron initialised on ``WORLD`` gloo ranks, the tiny checkpoint loaded."""
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    from ._megatron_cpu import apply_cpu_shims, init_megatron

    torch.set_num_threads(1)
    apply_cpu_shims()
    init_megatron(rank, WORLD, port)
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
    model = bridge.build_model()
    load_hf_checkpoint(model, ckpt, bridge)
    return bridge, model


def _run(rank, port, ckpt, out):
    from megatron_trace.bridge import export_hf_weights

    from ..megatron.harness import MegatronTraining
    from ._megatron_cpu import shutdown_megatron

    bridge, model = _loaded(rank, port, ckpt)
    training = MegatronTraining(model, model.config, overlap=True)
    ddp = training.ddp
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    pos, mask = torch.arange(SEQ).expand(2, SEQ), torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    training.step(lambda m: m(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean())
    after_step = {n: t.clone() for n, t in export_hf_weights(ddp, bridge)}
    with torch.no_grad():
        ddp(tokens, pos, mask)  # (its pre-hooks gather whatever was not gathered)
    after_forward = {n: t.clone() for n, t in export_hf_weights(ddp, bridge)}
    torch.save({"after_step": after_step, "after_forward": after_forward}, os.path.join(out, f"rank{rank}.pt"))
    shutdown_megatron()


def _worker_before_step(rank: int, port: int, ckpt: str, out: str) -> None:
    from megatron_trace.testing.megatron_cpu import record_errors

    with record_errors(out, rank):
        _run_before_step(rank, port, ckpt, out)


def _run_before_step(rank, port, ckpt, out):
    """Two steps, the second with or without an export between its gradient sync and ``optimizer.step()``; the
    logits of the forward after it."""
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, export_hf_weights, load_hf_checkpoint

    from ..megatron.harness import MegatronTraining
    from ._megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    torch.set_num_threads(1)
    apply_cpu_shims()
    init_megatron(rank, WORLD, port)
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    pos, mask = torch.arange(SEQ).expand(2, SEQ), torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    got = {}
    for export in (False, True):
        model = bridge.build_model()
        load_hf_checkpoint(model, ckpt, bridge)
        training = MegatronTraining(model, model.config, overlap=True)
        ddp = training.ddp
        loss = lambda m: m(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()  # noqa: E731
        training.step(loss)
        ddp.zero_grad_buffer()  # (MegatronTraining.step by hand: the export goes between its last two lines)
        with training._on_cpu:
            training.optimizer.zero_grad()
        loss(ddp).backward()
        ddp.finish_grad_sync()
        if export:
            for _ in export_hf_weights(ddp, bridge):
                pass
        with training._on_cpu:
            assert training.optimizer.step()[0]
        with torch.no_grad():
            got[export] = ddp(tokens, pos, mask)
    torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    shutdown_megatron()


def _worker_fsdp2(rank: int, port: int, ckpt: str, out: str) -> None:
    from megatron_trace.testing.megatron_cpu import record_errors

    with record_errors(out, rank):
        _run_fsdp2(rank, port, ckpt, out)


def _run_fsdp2(rank, port, ckpt, out):
    """The export of the unwrapped model; of the same model under torch FSDP2 (sharded as Megatron's wrapper does),
    before and after an Adam step on this rank's batch; the error of an export of Megatron-FSDP's parameters."""
    import torch.distributed as dist

    from megatron_trace.bridge import export_hf_weights, load_hf_checkpoint

    from ..megatron._fsdp import fully_shard_as_megatron
    from ._megatron_cpu import shutdown_megatron

    bridge, model = _loaded(rank, port, ckpt)
    got = {"unwrapped": {n: t.clone() for n, t in export_hf_weights(model, bridge)}}
    fully_shard_as_megatron(model, dist.group.WORLD)
    got["sharded"] = {n: (type(t).__name__, t.clone()) for n, t in export_hf_weights(model, bridge)}
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    pos, mask = torch.arange(SEQ).expand(2, SEQ), torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean().backward()
    torch.optim.Adam(model.parameters(), lr=1e-2).step()
    got["stepped"] = {n: (type(t).__name__, t.clone()) for n, t in export_hf_weights(model, bridge)}
    try:
        load_hf_checkpoint(model, ckpt, bridge)
    except ValueError as e:
        got["load"] = str(e)
    next(model.parameters()).__fsdp_param__ = True  # (what Megatron-FSDP sets on the parameters it manages)
    try:
        next(iter(export_hf_weights(model, bridge)))
    except ValueError as e:
        got["megatron_fsdp"] = str(e)
    torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    shutdown_megatron()


def test_export_under_torch_fsdp2_gathers_the_shards(tmp_path):
    """The export yielded each rank's DTensor shards (with the whole tensor's shape) for the full weights; a load into
    the wrapped model failed inside torch ("got mixed torch.Tensor and DTensor"): refused by name."""
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    port = free_port()
    codes = spawn_ranks(_worker_fsdp2, WORLD, lambda r: (r, port, ckpt, str(tmp_path)), timeout=240)
    errors = [e.read_text() for e in (tmp_path / f"error{r}.txt" for r in range(WORLD)) if e.exists()]
    assert not errors and codes == [0] * WORLD, errors or codes
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    want = got[0]["unwrapped"]
    for r in range(WORLD):
        assert got[r]["sharded"].keys() == want.keys()
        for n, (kind, t) in got[r]["sharded"].items():
            assert kind == "Tensor" and torch.equal(t, want[n]), (r, n, kind)
        for n, (kind, t) in got[r]["stepped"].items():  # one model on both ranks
            assert kind == "Tensor" and torch.equal(t, got[0]["stepped"][n][1]), (r, n, kind)
        assert "Megatron-FSDP's parameters (--use-megatron-fsdp) are not exported" in got[r]["megatron_fsdp"]
        assert "sharded by a data-parallel wrapper (embedding.word_embeddings.weight is a DTensor of shape " \
            "(128, 64)): load the HF checkpoint into the model before wrapping it" in got[r]["load"], got[r]["load"]
    assert any(not torch.equal(t, want[n]) for n, (_, t) in got[0]["stepped"].items())  # (the step changed them)


def test_export_after_an_overlapped_step_gathers_the_parameters(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    port = free_port()
    codes = spawn_ranks(_worker, WORLD, lambda r: (r, port, ckpt, str(tmp_path)), timeout=240)
    errors = [e.read_text() for e in (tmp_path / f"error{r}.txt" for r in range(WORLD)) if e.exists()]
    assert not errors and codes == [0] * WORLD, errors or codes
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    want = got[0]["after_forward"]
    for r in range(WORLD):
        stale = [n for n, t in want.items() if not torch.equal(got[r]["after_step"][n], t)]
        assert not stale, (r, len(stale), len(want), stale[:3])
        assert all(torch.equal(got[r]["after_forward"][n], t) for n, t in want.items()), r
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        assert any(not torch.equal(f.get_tensor(n), t) for n, t in want.items())  # (the step changed them)


def test_an_export_before_the_step_leaves_the_next_forward_its_all_gather(tmp_path):
    """The export's synchronous all-gather marks the buckets gathered; after the step that follows, the next
    forward's pre-hooks must gather the step's update all the same (they skipped it: stale logits on both ranks)."""
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    port = free_port()
    codes = spawn_ranks(_worker_before_step, WORLD, lambda r: (r, port, ckpt, str(tmp_path)), timeout=240)
    errors = [e.read_text() for e in (tmp_path / f"error{r}.txt" for r in range(WORLD)) if e.exists()]
    assert not errors and codes == [0] * WORLD, errors or codes
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert torch.equal(got[True], got[False]), (r, (got[True] - got[False]).abs().max())
