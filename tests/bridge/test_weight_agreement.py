"""Weight agreement (USER_NEEDS.md §3, §5): the expert weights the TRACE trainer computes with in its forward
(``TraceExpertsCore.quantize_weights``: prepared as the MoE layer starts, reused over micro-batches by
``reuse_weight_quant``) equal, bit for bit, the weights the hf rollout computes with after a weight sync, in the
configurations both sides accept: format and MXFP4 scale rule, BF16 or packed FP4 on the wire, a layer's experts kept
BF16 (``exclude_modules``), experts of extreme magnitude, expert parallelism, and sync rounds around optimizer steps
(a stale block scale or amax on either side would differ)."""

import contextlib
import os

import pytest
import torch

from megatron_trace.config import TraceConfig

from ..rollout._tiny import tiny_config, tiny_model
from ._megatron_cpu import free_port, spawn_ranks

CONFIG = tiny_config(num_hidden_layers=2)
H, F = CONFIG.hidden_size, CONFIG.moe_intermediate_size
TOKENS = torch.randint(3, 128, (4, 10), generator=torch.Generator().manual_seed(0))
BF16_MAX = torch.finfo(torch.bfloat16).max
CONFIGS = {
    "nvfp4": TraceConfig(),
    "mxfp4-floor": TraceConfig(format="mxfp4"),
    "mxfp4-ceil": TraceConfig(format="mxfp4", mxfp4_scale_rule="ceil"),
    "nvfp4-layer1-bf16": TraceConfig(exclude_modules=("model.layers.1.mlp.experts",)),
    "mxfp4-layer0-bf16": TraceConfig(format="mxfp4", exclude_modules=("model.layers.0.mlp.experts",)),
    "bf16-weights": TraceConfig(sites=("expert_fc1_in", "expert_fc2_in"), guided_sites=("expert_fc1_in",)),
}


def _extreme_checkpoint(path, bf16_max: bool = False) -> str:
    """Layer 0's experts: expert 1 all zeros (amax 0), expert 2 subnormal, expert 3 below 2688 / FLT_MAX (NVFP4's
    encode scale saturates), one huge outlier in every other expert; ``bf16_max``: +-bf16 max in experts 0 and 4."""
    model = tiny_model(CONFIG, seed=5)
    ex = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in (ex.gate_up_proj, ex.down_proj):  # [E, 2F, H], [E, H, F]
            w[1] = 0.0
            w[2] = torch.randn(w[2].shape, generator=g) * 1e-39
            w[3] *= 1e-37
            for e in (0, 4, 5, 6, 7):
                w[e, e, 3 * e % w.shape[-1]] = (-1) ** e * 1e4 * (e + 1)
            if bf16_max:
                w[0, 1, 1], w[4, 2, 5] = BF16_MAX, -BF16_MAX
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _extreme_checkpoint(tmp_path_factory.mktemp("agree") / "hf")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@contextlib.contextmanager
def forward_weights(model, monkeypatch):
    """{(layer, "fc1" | "fc2"): [weight operand of each expert GEMM the trainer's forwards ran, [E, N, K]]}."""
    from megatron_trace.megatron import experts
    from megatron_trace.megatron.experts import TraceSequentialMLP

    seen, layer = {}, [None]
    mods = [m for m in model.modules() if isinstance(m, TraceSequentialMLP)]
    hooks = [m.register_forward_pre_hook(lambda m, args: layer.__setitem__(0, m.trace_layer)) for m in mods]
    gemm = experts.grouped_linear

    def recorded(x, w, counts, impl):
        seen.setdefault((layer[0], "fc1" if w.shape[-1] == H else "fc2"), []).append(w.detach().clone())
        return gemm(x, w, counts, impl)

    monkeypatch.setattr(experts, "grouped_linear", recorded)
    try:
        yield seen
    finally:
        monkeypatch.setattr(experts, "grouped_linear", gemm)
        for h in hooks:
            h.remove()


def rollout_weights(rollout) -> dict:
    """{(layer, "fc1" | "fc2"): the [E, N, K] weights the rollout's experts compute with}: the model's parameters
    (the reference path), which for FP4 experts must decode the FP4 store the GPU's grouped GEMMs read."""
    out = {}
    for layer in range(CONFIG.num_hidden_layers):
        ex = rollout.model.model.layers[layer].mlp.experts
        out[(layer, "fc1")], out[(layer, "fc2")] = ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone()
        if rollout.weight_store is not None and layer not in rollout.bf16_expert_layers:
            for which in ("fc1", "fc2"):
                stored = rollout.weight_store.stacked(layer, which).dequantize(out[(layer, which)].dtype)
                assert torch.equal(_bits(stored), _bits(out[(layer, which)])), (layer, which)
    return out


def assert_agree(seen: dict, rollout: dict) -> None:
    assert seen.keys() == rollout.keys(), sorted(seen)
    for key, ws in seen.items():
        for w in ws:  # every micro-batch's forward
            assert w.dtype == rollout[key].dtype and torch.equal(_bits(w), _bits(rollout[key])), key


def _policy(ckpt, cfg):
    """The demo's trainer (bf16 TRACE GPTModel loaded through the bridge, AdamW on fp32 masters) and its recipe."""
    from megatron_trace.manifest import trainer_recipe
    from megatron_trace.megatron import find_trace_layers
    from megatron_trace.rl.trainer import MegatronPolicy

    policy = MegatronPolicy(ckpt, cfg, quantized=True, lr=1e-2)
    return policy, trainer_recipe(find_trace_layers(policy.model))


def _rollout(ckpt, cfg, recipe):
    from megatron_trace.rollout import HFRolloutBackend

    rollout = HFRolloutBackend(ckpt, mode="fp4", trace_config=cfg, dtype=torch.bfloat16)
    rollout.check_recipe(recipe, ignore=("guided_layers", "guided_sites", "cache_mode"))  # as the RL driver does
    return rollout


def _sync(policy, rollout, recipe, cfg, wire: str, version: int) -> None:
    from megatron_trace.bridge.sync import sync_weights

    sync_weights(rollout, policy.export_hf_weights(), fmt=wire, quantizer=cfg.weight_quantizer(), version=version,
                 bf16_layers=rollout.bf16_expert_layers, recipe=recipe.with_weight_version(version))


def _train_step(policy, monkeypatch) -> dict:
    """Two micro-batches with the weights quantized once (``reuse_weight_quant``), then an optimizer step; returns
    the weights the forwards computed with."""
    from megatron_trace.megatron import reuse_weight_quant

    with forward_weights(policy.model, monkeypatch) as seen, reuse_weight_quant(policy.model):
        policy.forward_backward(TOKENS, 2, lambda i, lp, rows: -lp.mean())
    policy.optimizer.step()
    policy.optimizer.zero_grad()
    return seen


@pytest.mark.usefixtures("megatron_world1")
@pytest.mark.parametrize("wire", ["bf16", "fp4"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_trainers_forward_weights_are_the_rollouts_after_every_sync(ckpt, name, wire, monkeypatch):
    """Sync, step, sync: after each sync the rollout computes with exactly the weights of the trainer's next forward
    (both micro-batches of a step, then a plain forward)."""
    cfg = CONFIGS[name]
    policy, recipe = _policy(ckpt, cfg)
    rollout = _rollout(ckpt, cfg, recipe)
    if wire == "fp4" and not cfg.quantizes("weights"):  # the rollout has no FP4 weights to take them
        with pytest.raises(ValueError, match="FP4 weights need mode='fp4' with the 'weights' site"):
            _sync(policy, rollout, recipe, cfg, wire, 1)
        assert rollout.policy_version == 0
        wire = "bf16"
    rounds = []
    for version in (1, 2):
        _sync(policy, rollout, recipe, cfg, wire, version)
        if version == 1:
            seen = _train_step(policy, monkeypatch)
            assert all(len(ws) == 2 for ws in seen.values())
        else:
            with forward_weights(policy.model, monkeypatch) as seen, torch.no_grad():
                policy.logprobs(TOKENS)
        assert_agree(seen, rollout_weights(rollout))
        rounds.append(seen)
    moved = [k for k in rounds[0] if not torch.equal(_bits(rounds[0][k][0]), _bits(rounds[1][k][0]))]
    assert len(moved) == len(rounds[0])  # the step changed every layer's weights (the codes, where quantized)


@pytest.mark.usefixtures("megatron_world1")
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4-floor", "mxfp4-ceil"])
def test_bf16_max_weights_agree_whatever_they_quantize_to(tmp_path, name, monkeypatch):
    """+-bf16 max in an expert (its forward overflows, so no step): the trainer's quantized weights equal the rollout's
    through either wire (MXFP4's ceil rule decodes them to +-inf on both sides, documented in formats.mxfp4)."""
    from megatron_trace.megatron.experts import TraceSequentialMLP

    cfg = CONFIGS[name]
    path = _extreme_checkpoint(tmp_path / "hf", bf16_max=True)
    policy, recipe = _policy(path, cfg)
    mods = [m for m in policy.model.modules() if isinstance(m, TraceSequentialMLP)]
    with torch.no_grad():
        trainer = {(m.trace_layer, which): m._stacked(f"linear_{which}") for m in mods for which in ("fc1", "fc2")}
    for wire in ("bf16", "fp4"):
        rollout = _rollout(path, cfg, recipe)
        _sync(policy, rollout, recipe, cfg, wire, 1)
        assert_agree({k: [v] for k, v in trainer.items()}, rollout_weights(rollout))
    assert bool(torch.isinf(trainer[(0, "fc1")]).any()) == (name == "mxfp4-ceil")



@pytest.mark.usefixtures("megatron_world1")
@pytest.mark.parametrize("wire", ["bf16", "fp4"])
def test_an_fp32_trainers_sync_in_another_dtype_is_refused(ckpt, wire, monkeypatch):
    """An fp32 trainer and an fp32 rollout: the recipes agree (both quantize from float32), but the sync's default
    dtype rounded the weights to bf16 on the wire, so the rollout computed with other weights (and FP4 codes) than
    the trainer's forward (most fc1 elements differed in a probe). Refused now, naming the dtype to pass;
    with it the weights agree."""
    from megatron_trace.bridge.sync import sync_weights
    from megatron_trace.manifest import trainer_recipe
    from megatron_trace.megatron import find_trace_layers
    from megatron_trace.rl.trainer import MegatronPolicy
    from megatron_trace.rollout import HFRolloutBackend

    cfg = TraceConfig()
    policy = MegatronPolicy(ckpt, cfg, quantized=True, lr=1e-2, dtype=torch.float32)
    recipe = trainer_recipe(find_trace_layers(policy.model))
    rollout = HFRolloutBackend(ckpt, mode="fp4", trace_config=cfg, dtype=torch.float32, recipe=recipe)
    before = rollout_weights(rollout)
    kw = dict(fmt=wire, quantizer=cfg.weight_quantizer(), version=1, recipe=recipe.with_weight_version(1))
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16: the trainer's recipe says it quantizes its weights "
                                         r"from float32; .* pass dtype=torch.float32"):
        sync_weights(rollout, policy.export_hf_weights(), **kw)
    assert rollout.policy_version == 0 and all(torch.equal(v, rollout_weights(rollout)[k]) for k, v in before.items())
    sync_weights(rollout, policy.export_hf_weights(), dtype=torch.float32, **kw)
    with forward_weights(policy.model, monkeypatch) as seen, torch.no_grad():
        policy.logprobs(TOKENS)
    assert_agree(seen, rollout_weights(rollout))

# ---- expert parallelism: two CPU ranks (gloo) ------------------------------------------------------------------
EP = 2


def _ep_worker(rank: int, port: int, ckpt: str, out: str) -> None:
    from megatron_trace.testing.megatron_cpu import apply_cpu_shims, init_megatron, record_errors, shutdown_megatron

    with record_errors(out, rank):
        torch.set_num_threads(1)
        apply_cpu_shims()
        init_megatron(rank, EP, port, ep=EP)
        try:
            _ep_rounds(rank, ckpt, out)
        finally:
            shutdown_megatron()


def _ep_rounds(rank: int, ckpt: str, out: str) -> None:
    """Per config: sync, a step (two micro-batches), sync, a forward; rank 0 syncs a rollout per wire, every rank
    keeps the weights its forwards computed with (its local experts)."""
    mp = pytest.MonkeyPatch()
    saved = {}
    for name in ("nvfp4", "mxfp4-ceil"):
        cfg = CONFIGS[name]
        policy, recipe = _policy(ckpt, cfg)
        rollouts = {wire: _rollout(ckpt, cfg, recipe) for wire in ("bf16", "fp4")} if rank == 0 else {}
        for version in (1, 2):
            for wire in ("bf16", "fp4"):
                if rank == 0:
                    _sync(policy, rollouts[wire], recipe, cfg, wire, version)
                    saved[(name, wire, version, "rollout")] = rollout_weights(rollouts[wire])
                else:
                    for _ in policy.export_hf_weights():  # (the export's gathers: every rank iterates)
                        pass
            if version == 1:
                seen = _train_step(policy, mp)
            else:
                with forward_weights(policy.model, mp) as seen, torch.no_grad():
                    policy.logprobs(TOKENS[rank::EP])
            for wire in ("bf16", "fp4"):
                saved[(name, wire, version, "trainer")] = seen
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))


def test_expert_parallel_trainer_weights_are_the_rollouts(tmp_path):
    """EP=2: each rank's local experts, as its forwards compute with them, are the rollout's global experts
    ``rank * E / 2 + e`` after each sync (NVFP4 and MXFP4, BF16 and FP4 on the wire, before and after a step)."""
    ckpt = _extreme_checkpoint(tmp_path / "hf")
    port = free_port()
    codes = spawn_ranks(_ep_worker, EP, lambda r: (r, port, ckpt, str(tmp_path)), timeout=300)
    assert codes == [0] * EP, "an EP worker failed (see its stderr above)"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(EP)]
    local = CONFIG.num_experts // EP
    keys = [k[:3] for k in ranks[0] if k[3] == "rollout"]
    assert len(keys) == 8
    for key in keys:
        rollout = ranks[0][(*key, "rollout")]
        for r in range(EP):
            seen = ranks[r][(*key, "trainer")]
            assert_agree(seen, {k: v[r * local:(r + 1) * local] for k, v in rollout.items()})
