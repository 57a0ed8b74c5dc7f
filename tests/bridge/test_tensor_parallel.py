"""TP=2 (sequence parallel) on two CPU processes: the bridge scatters HF tensors into TP shards, gathers them back."""

import os
import re
import time

import pytest
import torch

from ..rollout._tiny import save_tiny_checkpoint, tiny_config
from ._megatron_cpu import free_port, spawn_ranks
from .test_expert_parallel import TOKENS, _disk

WORLD = 2


def _worker(rank: int, port: int, ckpt: str, out: str, tp: int = WORLD, etp: int = 1) -> None:
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, export_hf_weights, load_hf_checkpoint, save_hf_checkpoint
    from megatron_trace.testing.megatron_cpu import allow_torch_norm_with_sequence_parallel

    from ._megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    torch.set_num_threads(1)
    apply_cpu_shims()
    allow_torch_norm_with_sequence_parallel()  # TP MoE needs SP; the torch norm refuses the flag without Apex/TE
    init_megatron(rank, WORLD, port, tp=tp, etp=etp)
    try:
        # TP 2: experts are not tensor-parallel (ETP=1, as the TRACE plugin requires); attention and the router are.
        # TP 1, ETP 2 (a stock Megatron layout): only the experts are split
        bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(ckpt), dtype=torch.float32, expert_tensor_parallel_size=etp)
        model = bridge.build_model().eval()
        read = load_hf_checkpoint(model, ckpt, bridge).bytes
        qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
        fc1 = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
        b, s = TOKENS.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
        with torch.no_grad():
            logits = model(TOKENS, pos, mask)
            logits = gather_from_tensor_model_parallel_region(logits) if tp > 1 else logits  # vocab-parallel -> full
        disk = _disk(ckpt)
        exported = {n: t.clone() for n, t in export_hf_weights(model, bridge)}
        saved = save_hf_checkpoint(model, os.path.join(out, "saved"), bridge, max_shard_bytes=32 << 10)
        torch.save({
            "saved_files": saved,
            "read_bytes": read,
            "saved_dir": os.path.join(out, "saved"),
            "qkv_rows": qkv.shape[0],
            "expert_fc1_shape": tuple(fc1.shape),
            "logits": logits,
            "export_exact": exported.keys() == disk.keys() and all(torch.equal(exported[k], disk[k]) for k in disk),
        }, os.path.join(out, f"rank{rank}.pt"))
    finally:
        shutdown_megatron()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):  # a failed worker surfaces as a test failure, not a fixture error
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("tp2") / "hf", tiny_config(), seed=7)
    out = str(tmp_path_factory.mktemp("tp2_out"))
    port = free_port()
    codes = spawn_ranks(_worker, WORLD, lambda r: (r, port, ckpt, out), timeout=240)
    ok = codes == [0] * WORLD
    return ckpt, [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(WORLD)] if ok else None


def test_tp2_shards_logits_and_export(tp2_results):
    from transformers import AutoModelForCausalLM

    ckpt, results = tp2_results
    assert results is not None, "a TP worker failed (see its stderr above)"
    cfg = tiny_config()
    full_qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert all(r["qkv_rows"] == full_qkv_rows // WORLD for r in results)  # each rank holds half of QKV
    expert_fc1 = (2 * cfg.moe_intermediate_size, cfg.hidden_size)  # [gate; up] whole: experts are not TP-split
    assert all(r["expert_fc1_shape"] == expert_fc1 for r in results)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(TOKENS).logits
    for r in results:
        assert (r["logits"] - ref).abs().max() < 1e-4 * ref.abs().max()
        assert r["export_exact"]  # TP shards gathered back to the HF tensors bit for bit
    # rank 0 of the TP group reads and scatters; ETP is 1, so each rank reads the experts itself
    nbytes = {n: t.numel() * t.element_size() for n, t in _disk(ckpt).items()}
    assert results[0]["read_bytes"] == sum(nbytes.values())
    assert results[1]["read_bytes"] == sum(b for n, b in nbytes.items() if ".mlp.experts." in n)


def test_expert_tensor_parallel_without_tensor_parallel_exports_the_experts_whole(tmp_path):
    """TP 1, ETP 2: each rank holds half of every expert's rows (fc1 gate and up halves, fc2 columns); the export
    gathers them over the ETP group, the load scatters them, and the logits are transformers'."""
    from transformers import AutoModelForCausalLM

    ckpt = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=5)
    port = free_port()
    assert spawn_ranks(_worker, WORLD, lambda r: (r, port, ckpt, str(tmp_path), 1, WORLD), timeout=240) == [0] * 2
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    cfg = tiny_config()
    assert all(r["expert_fc1_shape"] == (2 * cfg.moe_intermediate_size // WORLD, cfg.hidden_size) for r in results)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(TOKENS).logits
    for r in results:
        assert (r["logits"] - ref).abs().max() < 1e-4 * ref.abs().max()
        assert r["export_exact"]


def test_tp2_save_writes_shards_from_rank_0_only(tp2_results):
    """Rank 1 gathers with rank 0 and keeps nothing; rank 0's shards hold the checkpoint bit for bit."""
    from safetensors.torch import load_file

    ckpt, results = tp2_results
    assert results is not None, "a TP worker failed (see its stderr above)"
    files = results[0]["saved_files"]
    assert results[1]["saved_files"] == [] and len(files) > 1
    saved = {}
    for f in files:
        saved.update(load_file(os.path.join(results[0]["saved_dir"], f)))
    disk = _disk(ckpt)
    assert saved.keys() == disk.keys() and all(torch.equal(saved[k], disk[k]) for k in disk)


def _refused_worker(rank: int, port: int, out: str, tp: int, etp: int, ep: int, config: str, cases: list) -> None:
    """Loads each case's checkpoint in turn into one model of ``config``'s directory (``cases``: this rank's (name,
    directory to load); the ranks agree on every refusal, so they stay in step for the next case) and saves each
    outcome."""
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint
    from megatron_trace.testing.megatron_cpu import allow_torch_norm_with_sequence_parallel

    from ._megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    torch.set_num_threads(1)
    apply_cpu_shims()
    allow_torch_norm_with_sequence_parallel()
    init_megatron(rank, WORLD, port, tp=tp, etp=etp, ep=ep, timeout_s=PG_TIMEOUT_S)  # a regression fails, not hangs
    try:
        hf_config = AutoConfig.from_pretrained(config)
        bridge = Qwen3MoeBridge(hf_config, dtype=torch.float32, expert_tensor_parallel_size=etp)
        model = bridge.build_model()
        for name, path in cases:
            start = time.monotonic()
            try:
                load_hf_checkpoint(model, path, bridge)
                outcome, notes = ("loaded", ""), []
            except Exception as e:  # recorded for the test
                outcome, notes = (type(e).__name__, str(e)), getattr(e, "__notes__", [])
            torch.save({"outcome": outcome, "notes": notes, "seconds": time.monotonic() - start},
                       os.path.join(out, f"{name}-rank{rank}.pt"))
    finally:
        shutdown_megatron()


PG_TIMEOUT_S = 30
LAYOUTS = {"tp2": (WORLD, 1, 1), "etp2": (1, WORLD, 1), "ep2": (1, 1, WORLD)}
"""(tp, etp, ep) of the refusal cases' runs."""
LACKS = "lacks"
"""A case's edits meaning: rank 1 loads from a directory that is not there."""
REFUSALS = {  # name: (layout, {tensor name: the shape it gets (zeros)} or LACKS)
    "rank0-tp2": ("tp2", {"model.layers.1.self_attn.o_proj.weight": (64, 48)}),  # read by TP rank 0 only
    "rank0-etp2": ("etp2", {"model.layers.0.mlp.experts.3.down_proj.weight": (64, 16)}),  # by ETP rank 0 only
    "ep-alone": ("ep2", {"model.layers.0.mlp.experts.5.down_proj.weight": (64, 16)}),  # experts 4..7: EP rank 1's
    "beyond": ("ep2", {"model.layers.0.mlp.experts.8.down_proj.weight": (4, 4),
                       "model.layers.3.mlp.experts.1.up_proj.weight": (4, 4)}),
    "one-tp-shape-o_proj": ("tp2", {"model.layers.1.self_attn.o_proj.weight": (64, 32)}),  # split on its columns
    "one-tp-shape-embed_tokens": ("tp2", {"model.embed_tokens.weight": (64, 64)}),  # vocab-parallel rows
    "one-tp-shape-lm_head": ("tp2", {"lm_head.weight": (64, 64)}),
    "lacks-ep2": ("ep2", LACKS),
    "lacks-tp2": ("tp2", LACKS),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """``refusals(name)``: (the case's checkpoint, what to load on rank 1, each rank's result). One two-process run
    per layout loads all of that layout's cases (``REFUSALS``), run at the first test that asks for one of them."""
    from safetensors.torch import load_file, save_file

    runs: dict = {}

    def run(layout: str) -> dict:
        root = tmp_path_factory.mktemp(layout)
        cases = {}
        for name, (where, edits) in REFUSALS.items():
            if where != layout:
                continue
            ckpt = save_tiny_checkpoint(root / name, tiny_config(), seed=5)
            if edits != LACKS:
                tensors = load_file(os.path.join(ckpt, "model.safetensors"))
                tensors.update({n: torch.zeros(shape) for n, shape in edits.items()})
                save_file(tensors, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
            cases[name] = (ckpt, str(root / "not_staged_here") if edits == LACKS else ckpt)
        port = free_port()
        config = next(iter(cases.values()))[0]  # (every case's model is tiny_config's)
        spawn_ranks(_refused_worker, WORLD, lambda r: (r, port, str(root), *LAYOUTS[layout], config,
                                                       [(n, c[r]) for n, c in cases.items()]), timeout=240)
        return {n: (ckpt, rank1, [torch.load(root / f"{n}-rank{r}.pt") for r in range(WORLD)])
                for n, (ckpt, rank1) in cases.items()}

    def case(name: str):
        layout = REFUSALS[name][0]
        if layout not in runs:
            runs[layout] = run(layout)
        return runs[layout][name]

    return case


@pytest.mark.parametrize("name", ["rank0-tp2", "rank0-etp2"])
def test_a_checkpoint_rank_0_refuses_raises_on_every_rank_at_once(refusals, name):
    """A shape only rank 0 reads is wrong: rank 0 refuses it, and rank 1 raises a ValueError naming rank 0 and the
    reason within seconds (it waited in the scatter until the process group's timeout)."""
    ckpt, _, results = refusals(name)
    (bad, shape), = REFUSALS[name][1].items()
    reason = rf"\['{bad}'\] -> .*the checkpoint's shape \[{tuple(shape)}\]".replace("(", r"\(").replace(")", r"\)")
    kind, msg = results[0]["outcome"]
    assert kind == "ValueError" and re.search(reason, msg), results[0]
    kind, msg = results[1]["outcome"]
    assert kind == "ValueError" and re.search(rf"^rank 0 refused to load the checkpoint {ckpt} .*{reason}", msg), msg
    assert all(r["seconds"] < 10 for r in results), [r["seconds"] for r in results]


def test_under_expert_parallel_alone_a_checkpoint_one_rank_refuses_raises_on_every_rank(refusals):
    """EP=2, TP=ETP=1 (no scatter): an expert only EP rank 1 reads has a wrong shape. Rank 1 refused it and rank 0
    returned as if loaded, to wait in the first collective of training; now rank 0 raises naming rank 1."""
    ckpt, _, results = refusals("ep-alone")
    (bad, _), = REFUSALS["ep-alone"][1].items()
    reason = re.escape(f"['{bad}'] -> ") + r".*the checkpoint's shape \[\(64, 16\)\]"
    kind, msg = results[1]["outcome"]
    assert kind == "ValueError" and re.search(reason, msg), results[1]
    kind, msg = results[0]["outcome"]
    where = re.escape(ckpt)
    assert kind == "ValueError" and re.search(rf"^rank 1 refused to load the checkpoint {where} .*{reason}", msg), msg


def test_under_expert_parallel_experts_beyond_the_config_are_refused_not_left_to_another_rank(refusals):
    """EP=2: an expert id >= num_experts (or of a layer >= num_layers) is no EP rank's: a config.json with fewer
    experts than the weights. Both ranks refuse it by name instead of each taking it for the other's."""
    _, _, results = refusals("beyond")
    extra = list(REFUSALS["beyond"][1])
    for r in range(WORLD):
        kind, msg = results[r]["outcome"]
        assert kind == "ValueError" and "2 checkpoint tensor(s) map to no parameter" in msg, (r, msg)
        assert all(n in msg for n in extra), (r, msg)


@pytest.mark.parametrize("part, whole", [("o_proj", (64, 64)), ("embed_tokens", (128, 64)), ("lm_head", (128, 64))])
def test_a_checkpoint_tensor_of_one_tp_rank_s_shape_is_refused_on_every_rank(refusals, part, whole):
    """A tensor of exactly one TP rank's shape is refused (mbridge's split would copy it to both ranks, each
    loading the same half as if it were its own): its whole shape is checked against the parameter's times TP."""
    name = f"one-tp-shape-{part}"
    ckpt, _, results = refusals(name)
    (bad, shape), = REFUSALS[name][1].items()
    reason = re.escape(f"['{bad}'] -> ") + ".*" + re.escape(
        f"the checkpoint's shape [{shape}] gives {shape} whole ({shape} per rank), the model's is {whole} whole "
        f"({shape} on each of {WORLD} ranks); does config.json match the checkpoint?")
    kind, msg = results[0]["outcome"]
    assert kind == "ValueError" and re.search(reason, msg), results[0]
    kind, msg = results[1]["outcome"]
    where = re.escape(ckpt)
    assert kind == "ValueError" and re.search(rf"^rank 0 refused to load the checkpoint {where} .*{reason}", msg), msg


@pytest.mark.parametrize("layout", ["ep2", "tp2"])
def test_a_checkpoint_directory_one_rank_lacks_raises_on_every_rank(refusals, layout):
    """The directory is missing where rank 1 looks (a node-local copy that was not staged): rank 1's
    FileNotFoundError was raised before the ranks' agreement, and rank 0 waited in it (a bare gloo error once rank 1
    exited; under NCCL, the process group's timeout); now rank 0 raises a ValueError naming rank 1 and why."""
    ckpt, missing, results = refusals(f"lacks-{layout}")
    reason = re.escape(f"{missing!r} is not a HF checkpoint directory (no config.json)")
    kind, msg = results[1]["outcome"]
    assert kind == "FileNotFoundError" and re.search(reason, msg), results[1]
    # the rank whose own error it is says so (its traceback is the one to read), and that the others name it
    assert f"(on rank 1 of {WORLD}; the other ranks raise naming it)" in results[1]["notes"], results[1]
    kind, msg = results[0]["outcome"]
    assert kind == "ValueError" and re.search(
        rf"^rank 1 refused to load the checkpoint {re.escape(ckpt)} .*FileNotFoundError: {reason}", msg), msg


def _file_size_limit(limit: int):
    """This process's files cannot grow past ``limit`` bytes (RLIMIT_FSIZE; writes fail with EFBIG, "File too large",
    the signal ignored): a real I/O error from the kernel on rank 0's first shard while the export's gathers are
    still to come."""
    import contextlib
    import resource
    import signal

    @contextlib.contextmanager
    def limited():
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)

    return limited()


def _failing_reads(after: int):
    """mbridge's reads (``safetensors.safe_open`` as its SafeTensorIO opens a file per tensor) fail with EIO from the
    ``after + 1``-th on, as a disk error mid-read would; the header checks before the scatters open files themselves."""
    import contextlib
    import errno

    import mbridge.core.safetensor_io as sio

    real, opened = sio.safe_open, []

    @contextlib.contextmanager
    def failing(path, *args, **kwargs):
        opened.append(path)
        if len(opened) > after:
            raise OSError(errno.EIO, "Input/output error", path)
        with real(path, *args, **kwargs) as f:
            yield f

    @contextlib.contextmanager
    def patched():
        sio.safe_open = failing
        try:
            yield
        finally:
            sio.safe_open = real

    return patched()


def _failing_rank_0_worker(rank: int, port: int, ckpt: str, out: str, case: str) -> None:
    import contextlib

    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint, save_hf_checkpoint
    from megatron_trace.testing.megatron_cpu import allow_torch_norm_with_sequence_parallel

    from ._megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    torch.set_num_threads(1)
    apply_cpu_shims()
    allow_torch_norm_with_sequence_parallel()
    init_megatron(rank, WORLD, port, tp=WORLD, timeout_s=PG_TIMEOUT_S)  # a regression fails, does not hang
    try:
        bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
        model = bridge.build_model()
        load_hf_checkpoint(model, ckpt, bridge)
        saved = os.path.join(out, "saved")
        save_hf_checkpoint(model, saved, bridge, max_shard_bytes=8 << 10)  # the earlier checkpoint
        failing = contextlib.nullcontext()
        if rank == 0:
            failing = _file_size_limit(16 << 10) if case == "save" else _failing_reads(after=4)
        start = time.monotonic()
        try:
            with failing:
                if case == "save":  # the embedding alone is a 32 KiB shard: shard 1 fails, at the export's 2nd tensor
                    save_hf_checkpoint(model, saved, bridge, max_shard_bytes=8 << 10)
                else:
                    load_hf_checkpoint(model, ckpt, bridge, memory_efficient=True)
            outcome = ("done", "")
        except Exception as e:  # recorded for the test
            outcome = (type(e).__name__, str(e))
        seconds = time.monotonic() - start
        try:  # the process group still works: every rank left the collectives together
            flag = torch.ones(1)
            torch.distributed.all_reduce(flag)
            dist_ok = flag.item() == WORLD
        except Exception:  # (a rank still waits in a collective of the failed call)
            dist_ok = False
        torch.save({"outcome": outcome, "seconds": seconds, "group_usable": dist_ok,
                    "saved": sorted(os.listdir(saved)),
                    "beside": sorted(n for n in os.listdir(out) if not n.endswith(".pt"))},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        shutdown_megatron()


@pytest.mark.parametrize("case, cause", [
    ("save", r"SafetensorError: Error while serializing: I/O error: File too large \(os error 27\)"),
    ("load", r"OSError: \[Errno 5\] Input/output error: '.*model\.safetensors'"),
])
def test_an_io_error_on_rank_0_raises_on_every_rank_at_once(tmp_path, case, cause):
    """TP=2. save: rank 0's first shard fails (EFBIG) while the export's gathers are still to come; rank 0 keeps
    joining them without writing, and the ranks agree at the end. load (memory_efficient: reads after the checks):
    rank 0's 5th read fails (EIO); it reads nothing more but keeps joining the scatters, and the ranks agree at the end.
    Rank 0 raises its error, rank 1 a RuntimeError naming rank 0 and the cause, in seconds (rank 1 waited in the
    export's gather / the scatter until the process group's timeout); the earlier checkpoint is intact."""
    ckpt = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=5)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    spawn_ranks(_failing_rank_0_worker, WORLD, lambda r: (r, port, ckpt, str(out), case), timeout=240)
    results = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    kind, msg = results[0]["outcome"]
    assert re.search(cause, f"{kind}: {msg}"), results[0]
    kind, msg = results[1]["outcome"]
    verb = "save" if case == "save" else "load"
    assert kind == "RuntimeError" and re.search(rf"^rank 0 failed to {verb} the checkpoint .*: {cause}", msg), msg
    assert all(r["seconds"] < 10 and r["group_usable"] for r in results), results
    files = results[0]["saved"]
    assert "model.safetensors.index.json" in files and len(files) > 5  # the earlier save's shards, all there
    assert results[0]["beside"] == ["saved"]  # no temporary directory left


def _dead_peer_worker(rank: int, port: int, ckpt: str, out: str) -> None:
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, save_hf_checkpoint
    from megatron_trace.testing.megatron_cpu import allow_torch_norm_with_sequence_parallel

    from ._megatron_cpu import apply_cpu_shims, init_megatron, shutdown_megatron

    torch.set_num_threads(1)
    apply_cpu_shims()
    allow_torch_norm_with_sequence_parallel()
    init_megatron(rank, WORLD, port, tp=WORLD, timeout_s=PG_TIMEOUT_S)  # a regression fails, does not hang
    ready = os.path.join(out, "rank0-past-the-collectives")
    try:
        bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
        model = bridge.build_model()
        torch.distributed.barrier()  # the last collective both ranks finish
        if rank == 1:  # dies once rank 0 is out of the barrier (its data read), before the save's agreement
            while not os.path.exists(ready):
                time.sleep(0.05)
            os._exit(0)
        open(ready, "w").close()
        start = time.monotonic()
        try:
            save_hf_checkpoint(model, os.path.join(out, "saved"), bridge)
            outcome = ("done", "")
        except Exception as e:  # recorded for the test
            outcome = (type(e).__name__, str(e))
        torch.save({"outcome": outcome, "seconds": time.monotonic() - start,
                    "beside": sorted(n for n in os.listdir(out) if n != os.path.basename(ready))},
                   os.path.join(out, "rank0.pt"))
    finally:
        shutdown_megatron()


def test_a_save_whose_agreement_fails_removes_rank_0_s_temporary_directory(tmp_path):
    """TP=2; rank 1 dies before the save. Rank 0 made its temporary directory, then the ranks' agreement (gloo's
    all_gather_object) raises on it: the temporary directory was left behind; now it is removed."""
    ckpt = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=5)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    spawn_ranks(_dead_peer_worker, WORLD, lambda r: (r, port, ckpt, str(out)), timeout=240)
    result = torch.load(out / "rank0.pt")
    assert result["outcome"][0] == "RuntimeError" and "gloo" in result["outcome"][1] and result["seconds"] < 10, result
    assert result["beside"] == [], result  # no ".saved.tmp-*" left, and no target
