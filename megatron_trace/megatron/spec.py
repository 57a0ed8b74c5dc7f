"""Specs: Megatron's GPT specs with TRACE experts and the KV site, through a ``BackendSpecProvider``.

``TraceSpecProvider(trace_config, fallback)`` works like Megatron's Kitchen provider: it answers
the experts and core-attention questions with TRACE modules and delegates everything else to its
fallback (``LocalSpecProvider`` by default, ``TESpecProvider`` for TE). ``MoELayer`` stays
Megatron's (``TransformerLayer`` checks its identity); only its ``experts`` submodule changes.

``trace_spec(spec, trace_config)`` converts any stock layer spec or block spec (what
Megatron-LM's ``gpt_builder`` made) and is what the launch patch calls. With TRACE disabled every
function returns Megatron's own spec object unchanged.
"""

from __future__ import annotations

import copy
import dataclasses

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ..config import ACTIVATION_SITES, KV_SITES, TraceConfig
from .attention import TraceDotProductAttention
from .experts import TraceExpertsCore, TraceSequentialMLP
from .te import TraceTEGroupedMLP, require_te, trace_te_attention_class

EXPERT_SITES = ("expert_fc1_in", "expert_fc2_in", "weights")


def _quantizes_experts(cfg: TraceConfig) -> bool:
    return any(cfg.quantizes(s) for s in EXPERT_SITES)


def _quantizes_kv(cfg: TraceConfig) -> bool:
    return any(cfg.quantizes(s) for s in KV_SITES)


def _bound(cls: type, trace_config: TraceConfig) -> type:
    """``cls`` with ``trace_config`` as its constructor's default (a subclass: isinstance checks still hold)."""

    def __init__(self, *args, trace_config: TraceConfig = trace_config, **kwargs):
        cls.__init__(self, *args, trace_config=trace_config, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


class TraceSpecProvider(BackendSpecProvider):
    """TRACE experts and KV attention; everything else from ``fallback``."""

    def __init__(self, trace_config: TraceConfig, fallback: BackendSpecProvider | None = None):
        if not isinstance(trace_config, TraceConfig):
            raise TypeError(f"trace_config must be a TraceConfig, got {type(trace_config).__name__}")
        self.trace_config = trace_config
        self.fallback = fallback if fallback is not None else LocalSpecProvider()

    # ---- delegated -----------------------------------------------------------------------------
    def linear(self) -> type:
        return self.fallback.linear()

    def column_parallel_linear(self) -> type:
        return self.fallback.column_parallel_linear()

    def row_parallel_linear(self) -> type:
        return self.fallback.row_parallel_linear()

    def fuse_layernorm_and_linear(self) -> bool:
        return self.fallback.fuse_layernorm_and_linear()

    def column_parallel_layer_norm_linear(self) -> type | None:
        return self.fallback.column_parallel_layer_norm_linear()

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return self.fallback.layer_norm(rms_norm=rms_norm, for_qk=for_qk)

    def activation_func(self) -> type:
        return self.fallback.activation_func()

    # ---- TRACE ---------------------------------------------------------------------------------
    def core_attention(self):
        """A ModuleSpec of the TRACE attention for the fallback's attention (its class if KV is off)."""
        return self.core_attention_spec(self.fallback.core_attention())

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        """(experts class, submodules), the class bound to this provider's ``trace_config``: Megatron's
        ``get_moe_module_spec_for_backend`` builds its ModuleSpec without params."""
        module, sub = self.fallback.grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)
        module, sub = self.experts_module(module, sub)
        return (_bound(module, self.trace_config) if issubclass(module, TraceExpertsCore) else module), sub

    def experts_params(self) -> dict:
        return {"trace_config": self.trace_config}

    def experts_module(self, module: type, submodules):
        """Map Megatron's experts class to the TRACE class with the same parameter layout."""
        if not self.trace_config.enabled or not _quantizes_experts(self.trace_config):
            return module, submodules
        if module is TEGroupedMLP:
            return TraceTEGroupedMLP, submodules
        if module in (SequentialMLP, GroupedMLP):
            # The legacy GroupedMLP (weight1/weight2, needs the grouped_gemm package) maps to the
            # SequentialMLP layout, which mbridge and checkpoints of the local spec use.
            sub = submodules or MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            return TraceSequentialMLP, sub
        raise ValueError(f"no TRACE experts for {module.__name__} (supported: SequentialMLP, GroupedMLP, TEGroupedMLP)")

    def experts_spec(self, spec: ModuleSpec) -> ModuleSpec:
        module, sub = self.experts_module(spec.module, spec.submodules)
        if module is spec.module:
            return spec
        return ModuleSpec(module=module, params={**spec.params, **self.experts_params()}, submodules=sub)

    def core_attention_spec(self, base):
        if not self.trace_config.enabled or not _quantizes_kv(self.trace_config):
            return base
        module = base.module if isinstance(base, ModuleSpec) else base
        params = dict(base.params) if isinstance(base, ModuleSpec) else {}
        if module is DotProductAttention:
            cls = TraceDotProductAttention
        elif module.__name__ == "TEDotProductAttention":
            cls = trace_te_attention_class()
        else:
            raise ValueError(f"no TRACE KV site for core attention {module.__name__}")
        return ModuleSpec(module=cls, params={**params, "trace_config": self.trace_config})

    def moe_module_spec(self, num_experts: int, moe_grouped_gemm: bool = False,
                        moe_use_legacy_grouped_gemm: bool = False) -> ModuleSpec:
        """Megatron's MoE spec (``MoELayer``) built with this provider, TRACE experts included."""
        spec = get_moe_module_spec_for_backend(
            backend=self.fallback, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
            moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm,
        )
        return self._convert_moe(spec)

    # ---- converting stock specs ----------------------------------------------------------------
    def _convert_moe(self, mlp: ModuleSpec) -> ModuleSpec:
        sub = dataclasses.replace(mlp.submodules, experts=self.experts_spec(mlp.submodules.experts))
        return dataclasses.replace(mlp, submodules=sub)

    def layer_spec(self, spec: ModuleSpec) -> ModuleSpec:
        """A stock TransformerLayer spec with TRACE experts (MoE layers) and KV site."""
        if not self.trace_config.enabled:
            return spec
        spec = copy.deepcopy(spec)
        sub = spec.submodules
        mlp = sub.mlp
        if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
            sub.mlp = self._convert_moe(mlp)
        attn = sub.self_attention
        if isinstance(attn, ModuleSpec) and hasattr(attn.submodules, "core_attention"):
            _refuse_latent_kv(attn.module, self.trace_config)
            attn.submodules.core_attention = self.core_attention_spec(attn.submodules.core_attention)
        return spec


def _refuse_latent_kv(attention: type, trace_config: TraceConfig) -> None:
    """Multi-latent attention (DeepSeek-V3's MLA) hands its core attention the per-head K and V decompressed from a
    latent row, but a rollout engine caches (and FP4-quantizes) the latent row itself: TRACE's KV sites there would
    round numbers no rollout computes, a train-rollout mismatch by construction. Refused; the experts convert. The
    fix named is the config's sites less K/V (the expert sites where none is left: no site would quantize nothing), and
    no ``kv_format`` (Megatron-LM refuses --trace-kv-format without a KV site); for Megatron-LM also the guided sites
    where they are not those --trace-sites alone gives (a --trace-guided-sites with a KV site would be refused)."""
    if _quantizes_kv(trace_config) and isinstance(attention, type) and issubclass(attention, MultiLatentAttention):
        kv = [s for s in trace_config.sites if s in KV_SITES]
        sites = tuple(s for s in trace_config.sites if s not in KV_SITES)
        guided = tuple(s for s in trace_config.guided_sites if s not in KV_SITES)
        if not sites:
            sites, guided = EXPERT_SITES, tuple(s for s in ACTIVATION_SITES if s in EXPERT_SITES)
        kv_format = ", kv_format=''" if trace_config.kv_format else ""
        no_kv_format = ", without --trace-kv-format" if trace_config.kv_format else ""
        flags = f"--trace-sites {','.join(sites)}"
        if set(guided) != {s for s in ACTIVATION_SITES if s in sites}:  # (not --trace-guided-sites' default)
            flags += f" --trace-guided-sites {','.join(guided) or repr('')}"
        raise ValueError(
            f"TRACE's KV sites {kv} quantize per-head K/V at the core attention, but {attention.__name__} "
            "(multi-latent attention) is cached by rollout engines as its compressed latent row: no rollout computes "
            f"those numbers. Quantize the experts only: TraceConfig(sites={sites}, guided_sites={guided}{kv_format}) "
            f"(Megatron-LM: {flags}{no_kv_format})")


def trace_spec(spec, trace_config: TraceConfig, fallback: BackendSpecProvider | None = None):
    """Convert a stock layer spec (``ModuleSpec``) or block spec (``TransformerBlockSubmodules``)."""
    if not isinstance(trace_config, TraceConfig):  # (a dict: "'dict' object has no attribute 'enabled'")
        raise TypeError(f"trace_config must be a TraceConfig (TraceConfig.from_dict for a dict), got "
                        f"{type(trace_config).__name__}")
    if not trace_config.enabled:
        return spec
    provider = TraceSpecProvider(trace_config, fallback)
    if isinstance(spec, TransformerBlockSubmodules):
        converted = {}  # layer specs are shared between layers: convert each object once
        layers = [converted.setdefault(id(s), provider.layer_spec(s)) for s in spec.layer_specs]
        return dataclasses.replace(spec, layer_specs=layers)
    if isinstance(spec, ModuleSpec):
        return provider.layer_spec(spec)
    raise TypeError(f"expected a ModuleSpec or TransformerBlockSubmodules, got {type(spec).__name__}")


def get_trace_gpt_layer_spec(trace_config: TraceConfig, num_experts: int | None = None,
                             moe_grouped_gemm: bool = False, *, use_te: bool = False, **stock_kwargs) -> ModuleSpec:
    """Megatron's GPT layer spec (local, or TE with ``use_te``) with TRACE experts and KV site."""
    if use_te:
        require_te()
    build = get_gpt_layer_with_transformer_engine_spec if use_te else get_gpt_layer_local_spec
    stock = build(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, **stock_kwargs)
    return trace_spec(stock, trace_config)


def get_trace_decoder_block_spec(trace_config: TraceConfig, config, use_transformer_engine: bool = False,
                                 normalization: str | None = None, qk_l2_norm: bool | None = False,
                                 vp_stage: int | None = None, pp_rank: int | None = None):
    """Megatron's GPT decoder block spec (MoE/dense pattern, pipeline slicing) with TRACE modules."""
    if use_transformer_engine:
        require_te()
    stock = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, normalization=normalization, qk_l2_norm=qk_l2_norm,
        vp_stage=vp_stage, pp_rank=pp_rank,
    )
    return trace_spec(stock, trace_config)
