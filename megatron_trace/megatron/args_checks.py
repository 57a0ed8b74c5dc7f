"""The ``--trace-*`` flags against Megatron-LM's own flags: what ``trace_config_from_args`` refuses before the model
is built (the patched ``gpt_builder`` calls it first), with the flag to change.

Each check mirrors a limit that would otherwise surface later or as someone else's error: Megatron's ``NameError``
without Transformer Engine, TRACE's experts refusing Megatron's options as each layer is built, an
``exclude_modules`` pattern that matches nothing at the first train step, or a flag that would do nothing.
"""

from __future__ import annotations

import logging

from ..config import KV_SITES, TraceConfig
from ..guidance.selection import guided_layers
from ..manifest import ModulePatternError, check_guided_layers, excluded_modules, unguided_layers
from .experts import _DISPATCHERS as _DISPATCHER_CLASSES
from .experts import EXPERT_OFFLOAD_MODULES
from .sharding import MEGATRON_FSDP_REFUSED

EXPERT_SITES = ("expert_fc1_in", "expert_fc2_in", "weights")
DISPATCHERS = tuple(_DISPATCHER_CLASSES)
"""The token dispatchers whose rows TRACE's experts can guide."""

logger = logging.getLogger(__name__)


def moe_layer_ids(num_experts, moe_layer_freq, num_layers: int) -> list[int]:
    """MoE layer ids of the whole model from Megatron's ``moe_layer_freq`` (an int N or a 0/1 list)."""
    if not num_experts:
        return []
    if isinstance(moe_layer_freq, int):
        return [i for i in range(num_layers) if i % moe_layer_freq == 0]
    return [i for i, moe in enumerate(moe_layer_freq) if moe]


def check_against_model(cfg: TraceConfig, args) -> None:
    """Raise for ``--trace-fp4`` launch args the model Megatron would build cannot honour (``cfg.enabled`` only).
    A Megatron flag missing from ``args`` (a parser of its own around ``add_trace_args``) is not checked; without
    ``num_experts`` the model's MoE layers are unknown."""
    if not cfg.enabled:
        return
    check_not_modelopt(args)
    if getattr(args, "use_legacy_models", False):
        raise ValueError("--trace-fp4 needs Megatron-Core models: --use-legacy-models builds megatron.legacy's GPT, "
                         "which takes no layer spec (TRACE's modules would not be built); drop --use-legacy-models")
    num_layers = getattr(args, "num_layers", None)
    if num_layers:
        try:
            guided_layers(cfg, int(num_layers))
        except ValueError as e:
            raise ValueError(f"invalid --trace-guided-layers for --num-layers {num_layers}: {e}") from None
    known = hasattr(args, "num_experts")  # (Megatron-LM's args hold it, None for a dense model)
    moe = bool(getattr(args, "num_experts", None))
    experts = moe and any(map(cfg.quantizes, EXPERT_SITES))
    # (no site at all quantizes nothing whatever the model: a parser of its own around add_trace_args too)
    if (known or not cfg.sites) and not experts and not any(map(cfg.quantizes, KV_SITES)):
        raise ValueError(f"--trace-fp4 would quantize nothing: --trace-sites {','.join(cfg.sites)} has no KV site "
                         f"(kv_k, kv_v) and {_no_experts(moe or not known)}")
    if num_layers and known:
        _check_guided_layers_have_sites(cfg, args, int(num_layers))
    if cfg.routing_replay and moe and getattr(args, "moe_enable_routing_replay", None) is False:
        raise ValueError("--trace-routing-replay (the default) needs Megatron's --moe-enable-routing-replay; "
                         "add it, or pass --no-trace-routing-replay")
    if cfg.routing_replay and moe and getattr(args, "moe_router_fusion", False):
        raise ValueError("--trace-routing-replay (the default) does not work with --moe-router-fusion: Megatron's "
                         "fused top-k never consults its RouterReplay, so the rollout's expert choices would not be "
                         "replayed; drop --moe-router-fusion, or pass --no-trace-routing-replay")
    if experts:
        _check_expert_options(args)
        _check_sharded_data_parallel(args)
        if num_layers and guided_layers(cfg, int(num_layers)):
            _warn_dropping(cfg, args)
    if getattr(args, "trace_reuse_weight_quant", False):
        _check_reuse(cfg, args, moe or not known)
    if cfg.exclude_modules and num_layers and known:  # (else at the first train step, by find_trace_layers)
        moe_layers = moe_layer_ids(getattr(args, "num_experts", None), getattr(args, "moe_layer_freq", 1),
                                   int(num_layers))
        try:
            excluded_modules(cfg, moe_layers=moe_layers, attention_layers=range(int(num_layers)))
        except ModulePatternError as e:
            raise ModulePatternError(f"--trace-exclude-modules: {e}") from None
        if cfg.guided_layers != "budget":
            try:
                check_guided_layers(cfg, guided_layers(cfg, int(num_layers)), moe_layers=moe_layers)
            except ValueError as e:
                raise ValueError(f"--trace-guided-layers with --trace-exclude-modules: {e}") from None
    if getattr(args, "transformer_impl", None) == "transformer_engine":
        _check_te_imports()


def _check_guided_layers_have_sites(cfg: TraceConfig, args, num_layers: int) -> None:
    """Guided layers where no guided site is: the K/V sites are in every layer, the expert sites in the MoE layers
    only (``--moe-layer-freq``). A listed layer without one, or a policy none of whose layers has one, would guide
    nothing, silently; so would a ``--trace-guided-layers`` given with no guided site at all."""
    guided = guided_layers(cfg, num_layers)
    if not guided:
        return
    sites = [s for s in cfg.guided_sites if cfg.quantizes(s)]
    layers_flag = getattr(args, "trace_guided_layers", None)
    if not sites:
        if layers_flag is not None:
            raise ValueError(f"--trace-guided-layers {_layers_text(layers_flag)} would do nothing: there is no guided "
                             "site (--trace-guided-sites is empty); name the sites to guide, or drop "
                             "--trace-guided-layers")
        return
    moe_layers = moe_layer_ids(getattr(args, "num_experts", None), getattr(args, "moe_layer_freq", 1), num_layers)
    missing = unguided_layers(cfg, list(guided), moe_layers=set(moe_layers), exclusions=False)  # (those: below)
    if not missing:
        return
    where = (f"the MoE layers {moe_layers} (--moe-layer-freq)" if moe_layers else
             "no layer: the model has no MoE layers (no --num-experts)")
    what = f"layer(s) {missing}" if cfg.guided_layers == "explicit" else \
        f"{cfg.guided_layers!r} picks layer(s) {list(guided)}, which"
    raise ValueError(f"--trace-guided-layers: {what} have no guided site: --trace-guided-sites {','.join(sites)} "
                     f"(expert sites only) are in {where}; guide MoE layers, or add kv_k,kv_v to the guided sites")


def _layers_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def check_not_modelopt(args) -> None:
    """ModelOpt's model (``--modelopt-enabled``; Megatron-LM's ``get_model`` also sets it when ``--load`` holds a
    ModelOpt checkpoint) is built by ModelOpt's builder, which never applies TRACE's layer spec."""
    if getattr(args, "modelopt_enabled", False):
        raise ValueError("--trace-fp4 cannot run on a ModelOpt model: with --modelopt-enabled (also set by "
                         "Megatron-LM when --load holds a ModelOpt checkpoint) Megatron-LM builds the model with "
                         "ModelOpt's builder, which never applies TRACE's layer spec; drop --modelopt-enabled and "
                         "load a checkpoint without ModelOpt state, or drop --trace-fp4")


def _no_experts(moe: bool) -> str:
    return ("the routed experts are not quantized (no expert_fc1_in, expert_fc2_in or weights)" if moe else
            "the model has no MoE layers (no --num-experts): add kv_k,kv_v to --trace-sites, or --num-experts")


def _check_te_imports() -> None:
    """Megatron's TE layer specs without TE fail with a NameError (``TENorm``), TRACE or not: said with the fix."""
    from .te import require_te

    try:
        require_te()
    except ImportError as e:
        raise ImportError(
            f"--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, which does not "
            f"import here ({e.__cause__ or e}): install it (pip install 'megatron_trace[te]'), or pass "
            "--transformer-impl local (with --no-gradient-accumulation-fusion --no-rope-fusion "
            "--no-masked-softmax-fusion --no-persist-layer-norm)") from e


def _check_expert_options(args) -> None:
    """Megatron MoE options TRACE's experts refuse at build time (``experts.check_expert_config``), said from the
    flags: Megatron would otherwise fail on some of them first (its fp8 recipe and flex dispatcher need TE / DeepEP)."""
    problems = []
    for dest, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format")):
        if getattr(args, dest, None):
            problems.append(f"{flag} {getattr(args, dest)} (Megatron's own low-precision recipe: TRACE quantizes the "
                            "experts itself; drop it)")
    kind = getattr(args, "moe_token_dispatcher_type", None)
    if kind is not None and kind not in DISPATCHERS:
        problems.append(f"--moe-token-dispatcher-type {kind} (supported: {', '.join(DISPATCHERS)})")
    if getattr(args, "recompute_granularity", None) == "selective" and "moe_act" in (
            getattr(args, "recompute_modules", None) or ()):
        problems.append("--recompute-modules moe_act (TRACE's experts do not checkpoint the expert activation: it "
                        "would stay in memory; recompute moe, the whole MoE layer, instead)")
    offload = [m for m in EXPERT_OFFLOAD_MODULES if m in (getattr(args, "offload_modules", None) or ())]
    if getattr(args, "fine_grained_activation_offloading", False) and offload:
        problems.append(f"--offload-modules {' '.join(offload)} (TRACE's experts do not offload their inputs to "
                        "the CPU: they would stay in device memory; drop them from --offload-modules)")
    if problems:
        raise ValueError("TRACE experts do not support " + "; ".join(problems))


def _check_sharded_data_parallel(args) -> None:
    """Sharded data parallelism TRACE's experts refuse (``sharding``): Megatron-FSDP, and torch FSDP2 with expert
    parallelism (Megatron's ``TorchFullyShardedDataParallel`` shards the experts over the data-parallel group,
    across the expert-parallel ranks: wrong weights, no error)."""
    for flag in ("--use-megatron-fsdp", "--use-custom-fsdp"):  # (the second: its older name, still accepted)
        if getattr(args, flag[2:].replace("-", "_"), False):
            raise ValueError(f"{flag} with --trace-fp4: {MEGATRON_FSDP_REFUSED}")
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if getattr(args, "use_torch_fsdp2", False) and ep > 1:
        raise ValueError(f"--use-torch-fsdp2 with --expert-model-parallel-size {ep}: Megatron's torch FSDP2 wrapper "
                         "shards every parameter over the data-parallel group, which spans the expert-parallel ranks, "
                         "so each rank's routed experts would be joined with another rank's in every forward (wrong "
                         "weights, no error); use --expert-model-parallel-size 1 with it, or Megatron's DDP with "
                         "--use-distributed-optimizer")


def _warn_dropping(cfg: TraceConfig, args) -> None:
    """Guidance rows follow the tokens only in dropless MoE: a step under ``trace_guidance`` with guided expert
    sites refuses a capacity factor or padded routing. Plain FP4 QAT (no guidance passed) runs with them, so the launch
    only warns."""
    flags = [f for f, on in (("--moe-expert-capacity-factor", getattr(args, "moe_expert_capacity_factor", None)
                              is not None),
                             ("--moe-router-padding-for-quantization",
                              getattr(args, "moe_router_padding_for_quantization", False))) if on]
    sites = [s for s in cfg.guided_sites if s in EXPERT_SITES and cfg.quantizes(s)]
    if flags and sites:
        logger.warning("%s: TRACE guidance of the expert sites %s needs dropless MoE, so a step given guidance "
                       "(trace_guidance) will refuse it; plain FP4 QAT runs. Drop %s for guided RL steps",
                       " and ".join(flags), sites, " and ".join(flags))


def _check_reuse(cfg: TraceConfig, args, moe: bool) -> None:
    """``--trace-reuse-weight-quant``: refused here rather than at the first train step (``reuse_weight_quant``), or
    where it would do nothing."""
    if cfg.ste_clip:
        raise ValueError("--trace-reuse-weight-quant needs --no-trace-ste-clip (the default): the clipped "
                         "straight-through gradient needs each micro-batch's mask")
    if not moe or not cfg.quantizes("weights"):
        why = "the model has no MoE layers (no --num-experts)" if not moe else \
            f"--trace-sites {','.join(cfg.sites)} does not quantize the weights"
        raise ValueError(f"--trace-reuse-weight-quant keeps the routed experts' fake-quantized weights for a step, "
                         f"and there are none: {why}; drop --trace-reuse-weight-quant")
    wrapper = [f for f in ("--use-torch-fsdp2", "--use-megatron-fsdp", "--use-custom-fsdp")
               if getattr(args, f[2:].replace("-", "_"), False)]
    if wrapper:
        raise ValueError(f"--trace-reuse-weight-quant does not work with {wrapper[0]}: the sharded data-parallel "
                         "wrapper gathers the experts' weights anew in every forward, so the kept fake-quantized "
                         "weights cannot be checked against them (the second micro-batch would fail as if the "
                         f"weights had been updated); drop --trace-reuse-weight-quant or {wrapper[0]}")
    if _te_grouped(args):
        raise ValueError("--trace-reuse-weight-quant supports TRACE's torch experts: --transformer-impl "
                         "transformer_engine with --moe-grouped-gemm builds TE's grouped experts, which fetch and "
                         "quantize their weights per call; use --transformer-impl local, or drop --moe-grouped-gemm "
                         "or --trace-reuse-weight-quant")


def _te_grouped(args) -> bool:
    """Whether the flags build TE's grouped experts (``TraceTEGroupedMLP``), not TRACE's torch experts."""
    return getattr(args, "transformer_impl", None) == "transformer_engine" and \
        getattr(args, "moe_grouped_gemm", False) and not getattr(args, "moe_use_legacy_grouped_gemm", False)
