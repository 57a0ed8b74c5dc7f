"""TraceConfig combinations on the SGLang side against the trainer: each is refused by name before the engine
serves it, or the engine quantizes exactly the sites the trainer's recipe lists and the backend delivers a record of
every guided (layer, site) pair. Runs in the main venv too, except the case that builds the engine's quant config."""

import pytest

from megatron_trace.config import KV_SITES, SITES, TraceConfig
from megatron_trace.guidance.selection import guided_layers
from megatron_trace.manifest import QuantRecipe, quantized_module_names
from megatron_trace.rollout import SamplingParams
from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend
from megatron_trace.rollout.sglang.launch import KV_FP4, trace_server_args

from ._common import needs_sglang
from .test_backend_contract import HF, _Engine

L = 3
SG = TraceConfig(kv_format="sglang_kvfp4", guided_layers="all")  # (as examples/sglang exports and serves it)
EXPERTS = ("expert_fc1_in", "expert_fc2_in")
CASES = {  # id: (the engine's and trainer's TraceConfig, the checkpoint's 'trace' entry, refusal or None)
    "default": (SG, None, None),
    "experts_only": (SG.replace(sites=(*EXPERTS, "weights"), guided_sites=EXPERTS), None, None),
    "per_tensor_full_last_k": (SG.replace(activation_amax="per_tensor", cache_mode="full", guided_layers="last_k",
                                          guided_last_k=1), None, None),
    # SGLang's fp4_e2m1 KV cache stores V in FP4 too: the trainer computed BF16 V, both recipes listed ('kv_k',)
    "kv_k_only": (SG.replace(sites=("expert_fc1_in", "kv_k", "weights"), guided_sites=("kv_k",)), None,
                  r"quantizes 'kv_k' but not 'kv_v'.*stores K and V both in FP4"),
    "kv_v_only": (SG.replace(sites=("kv_v", "weights"), guided_sites=()), None, r"quantizes 'kv_v' but not 'kv_k'"),
    # a pattern matching no module of these sites: the engine ignored it, the backend refused it once it had started
    "exclude_matches_nothing": (SG.replace(sites=(*EXPERTS, "weights"), guided_sites=EXPERTS,
                                           exclude_modules=("model.layers.1.self_attn.kv_cache",)), None,
                                r"exclude_modules pattern 'model.layers.1.self_attn.kv_cache' matches none"),
    # accepted here and refused only in the engine's scheduler process (TraceQuantConfig), once starting
    "mxfp4": (SG.replace(format="mxfp4"), None, r"format='mxfp4'.*NVFP4 checkpoints only"),
    # expert_fc2_in records need the routing: the engine was launched without it and every generate raised
    "no_routing_replay": (SG.replace(routing_replay=False), None, None),
    # the engine served the checkpoint's sites (FC2 quantized), the backend's recipe said the config's (no FC2)
    "checkpoint_trace_differs": pytest.param(SG.replace(sites=("expert_fc1_in", "weights"), guided_sites=()), SG,
                                             r"sites: checkpoint=.*expert_fc2_in.*engine=\('expert_fc1_in', "
                                             r"'weights'\)", marks=needs_sglang),
}


def trainer_recipe(cfg: TraceConfig) -> QuantRecipe:
    """``manifest.trainer_recipe`` of a 3-layer MoE trainer with ``cfg`` (every layer MoE and attention)."""
    return QuantRecipe.from_config(cfg, guided_layers=guided_layers(cfg, L), weight_version=0,
                                   quantized_modules=quantized_module_names(cfg, moe_layers=range(L),
                                                                            attention_layers=range(L)))


@pytest.mark.parametrize("cfg, checkpoint, refused", list(CASES.values()), ids=list(CASES))
def test_sglang_quantizes_and_records_what_the_trainer_does_or_refuses_by_name(cfg, checkpoint, refused):
    if checkpoint is not None:  # the engine's quant config, built in its scheduler after register(make_engine's)
        from megatron_trace.export import quant_config_dict
        from megatron_trace.rollout.sglang import quant
        from megatron_trace.rollout.sglang.launch import register

        prev = quant._RUNTIME_CONFIG
        register(cfg)
        try:
            with pytest.raises(ValueError, match=refused):
                quant.TraceQuantConfig.from_config(quant_config_dict([], trace_config=checkpoint.to_dict()))
            assert quant.TraceQuantConfig.from_config(quant_config_dict([], trace_config=cfg.to_dict())).trace == cfg
        finally:
            quant.set_runtime_config(prev)
        return
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            trace_server_args("/ckpt", cfg, HF, native=False)
        with pytest.raises(ValueError, match=refused):
            SGLangRolloutBackend(None, cfg, HF, native=False)
        return
    args = trace_server_args("/ckpt", cfg, HF, native=False)
    # what the engine quantizes: its method's activation sites (TraceQuantConfig's TraceConfig = make_engine's), the
    # expert weights always, and K and V both with an FP4 KV cache
    engine = {s for s in EXPERTS if cfg.quantizes(s)} | {"weights"}
    engine |= set(KV_SITES) if args["kv_cache_dtype"] == KV_FP4 else set()
    assert engine == set(cfg.sites)
    be = SGLangRolloutBackend(_Engine(), cfg, HF, native=False, kv_cache_dtype=args["kv_cache_dtype"],
                              recipe=trainer_recipe(cfg))
    assert be.recipe() == trainer_recipe(cfg)
    want = {(i, s) for i in guided_layers(cfg, L) for s in cfg.guided_sites}
    # FC2 rows are per (token, selected expert): their records need the routing, replayed or not
    assert args["enable_return_routed_experts"] == (cfg.routing_replay or "expert_fc2_in" in {s for _, s in want})
    batch = be.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=2))
    assert set(batch.guidance) == want
    for (layer, site), g in batch.guidance.items():
        fmt = cfg.kv_record_format if site in KV_SITES else cfg.format  # what the trainer's check_site accepts
        assert g.record.fmt == fmt and (g.expert_ids is not None) == (site == "expert_fc2_in"), (layer, site)
        assert type(g.record).__name__ == ("CompactGuidance" if cfg.cache_mode == "compact" else "FullGuidance")


@needs_sglang
def test_a_checkpoint_naming_the_engines_sites_in_another_order_is_served():
    """The checkpoint's 'trace' entry written from launch flags (``--trace-sites weights,...``) names the engine's
    sites and exclude patterns in another order: the engine quantizes the same, and it was refused as differing."""
    from megatron_trace.export import quant_config_dict
    from megatron_trace.rollout.sglang import quant
    from megatron_trace.rollout.sglang.launch import register

    cfg = SG.replace(exclude_modules=("model.layers.0.mlp.experts", "model.layers.2.mlp.experts"))
    checkpoint = cfg.replace(sites=cfg.sites[::-1], exclude_modules=cfg.exclude_modules[::-1])
    assert {s for s in SITES if checkpoint.quantizes(s)} == {s for s in SITES if cfg.quantizes(s)}
    prev = quant._RUNTIME_CONFIG
    register(cfg)
    try:
        served = quant.TraceQuantConfig.from_config(quant_config_dict([], trace_config=checkpoint.to_dict())).trace
        assert served == checkpoint
        with pytest.raises(ValueError, match=r"sites: checkpoint=.*engine="):  # another set of sites still differs
            quant.TraceQuantConfig.from_config(quant_config_dict([], trace_config=checkpoint.replace(
                sites=checkpoint.sites[1:]).to_dict()))
    finally:
        quant.set_runtime_config(prev)
