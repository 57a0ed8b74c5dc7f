"""The TRACE quantization method for SGLang 0.5.10 (``--quantization trace_nvfp4``). Imports sglang.

Checkpoint layout = ModelOpt NVFP4 (``export.modelopt``), plus optional exact ``weight_global_amax``.
Routed experts: ``TraceModelOptNvFp4MoEMethod`` (a ``ModelOptNvFp4FusedMoEMethod``, so SGLang's FusedMoE
weight loader and top-k scaling treat it as ModelOpt NVFP4; the loader picks its ModelOpt branch by class *name*,
``"ModelOpt" in method.__class__.__name__``, hence the name):
  * capability >= 10 (Blackwell): SGLang's native NVFP4 MoE kernels (``native=True``), the fc1
    input recorded from SGLang's own quantize op (``native.py``; UNVERIFIED, no such GPU here);
  * elsewhere: W4A4 emulation, ``fp4_moe.w4a4_experts_forward`` (the hf backend's numerics) on the
    packed weights, per-row RNE activations; guidance rows go to ``capture.active_capture()``.
``TraceConfig.exclude_modules`` experts get no method: SGLang's BF16 ``UnquantizedFusedMoEMethod``.
Other quantized Linears: ``TraceNvFp4LinearMethod``, registered for SGLang's v2 weight loader (``register``; the
v1 loaders of fused QKV / gate-up Linears cannot load per-tensor scales).
No derived tensor is kept in the emulated path, so in-place weight updates (update_weights_from_*)
need no post-processing; the native path re-runs ``process_weights_after_loading`` after an in-process sync
(``weights.load_and_postprocess``), which ``update_weights_from_distributed`` does not call: the backend refuses
an NCCL weights group with the native path.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
import torch.nn.functional as F
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.moe.utils import get_moe_runner_backend
from sglang.srt.layers.parameter import ModelWeightParameter, PerTensorScaleParameter
from sglang.srt.layers.quantization.base_config import LinearMethodBase
from sglang.srt.layers.quantization.modelopt_quant import (
    ModelOptFp4Config,
    ModelOptFp4LinearMethod,
    ModelOptNvFp4FusedMoEMethod,
)
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from ...config import TraceConfig
from ...formats import FP4Tensor
from ...manifest import experts_name, module_excluded
from ..fp4_moe import PackedExperts, silu_and_mul, w4a4_experts_forward
from . import native as native_path
from .capture import active_capture
from .launch import METHOD_NAME, check_emulated_moe_parallel, check_emulated_runner, check_serves_fp4_weights
from .native import native_fp4_available

logger = logging.getLogger(__name__)

_ENC = 6.0 * 448.0
_RUNTIME_CONFIG: TraceConfig | None = None
_EXPERTS_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")


def set_runtime_config(config: TraceConfig | None) -> None:
    """The TraceConfig used when the checkpoint's quant config carries none (set by ``register``)."""
    global _RUNTIME_CONFIG
    _RUNTIME_CONFIG = config


def experts_layer(prefix: str) -> int | None:
    """The layer number of a FusedMoE prefix ``model.layers.L.mlp.experts`` (None for another module)."""
    m = _EXPERTS_PREFIX.search(prefix)
    return int(m.group(1)) if m else None


def trace_excludes(trace: TraceConfig, prefix: str) -> bool:
    """Whether ``TraceConfig.exclude_modules`` keeps this FusedMoE in BF16 (as the hf backend and trainer do)."""
    layer = experts_layer(prefix)
    return layer is not None and module_excluded(trace, experts_name(layer))


def global_amax(amax: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Exact amax where loaded, else derived from ModelOpt's ``weight_scale_2`` (= amax / 2688)."""
    return torch.where(torch.isnan(amax), scale_2.float() * _ENC, amax)


def _amax_param(shape, weight_loader) -> PerTensorScaleParameter:
    return PerTensorScaleParameter(data=torch.full(shape, float("nan"), dtype=torch.float32),
                                   weight_loader=weight_loader)


class TraceQuantConfig(ModelOptFp4Config):
    """ModelOpt NVFP4 checkpoint config + a ``TraceConfig`` (from the checkpoint's ``trace`` entry or ``register``)."""

    def __init__(self, trace: TraceConfig | None = None, exclude_modules: list[str] | None = None,
                 group_size: int = 16, packed_modules_mapping: dict | None = None, native: bool | None = None):
        super().__init__(True, None, group_size, exclude_modules or [], packed_modules_mapping)
        self.trace = trace or _RUNTIME_CONFIG or TraceConfig()
        if self.trace.format != "nvfp4":
            raise ValueError(f"trace_nvfp4 serves NVFP4 checkpoints; TraceConfig.format={self.trace.format!r}")
        check_serves_fp4_weights(self.trace)
        if group_size != 16:
            raise ValueError(f"NVFP4 group_size must be 16, the checkpoint says {group_size}")
        self.native = native_fp4_available() if native is None else native

    @classmethod
    def get_name(cls) -> str:
        return METHOD_NAME

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # emulation runs anywhere torch does; native kernels need 100

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.half]

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant) -> str | None:
        return METHOD_NAME if user_quant == METHOD_NAME else None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TraceQuantConfig:
        base = ModelOptFp4Config.from_config(config)
        trace = config.get("trace")
        trace = TraceConfig.from_dict(trace) if trace else None
        check_engine_fields(trace, _RUNTIME_CONFIG)
        return cls(trace, base.exclude_modules, base.group_size, config.get("packed_modules_mapping"))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            if self.is_layer_excluded(prefix) or _skipped(prefix, self):
                return UnquantizedLinearMethod()
            return TraceNvFp4LinearMethod(self)
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE  # needs the CUDA kernels package

        if isinstance(layer, FusedMoE) and not (self.is_layer_excluded(prefix) or trace_excludes(self.trace, prefix)):
            return TraceModelOptNvFp4MoEMethod(self)
        return None  # FusedMoE falls back to UnquantizedFusedMoEMethod (BF16)


ENGINE_FIELDS = ("enabled", "format", "mxfp4_scale_rule", "sites", "activation_amax", "exclude_modules")
"""The TraceConfig fields that decide what the engine quantizes and how (its rounding is RNE whatever ``rounding``)."""


def check_engine_fields(checkpoint: TraceConfig | None, runtime: TraceConfig | None) -> None:
    """The checkpoint's ``trace`` entry is what the engine serves, ``register``'s config (``make_engine``'s) what the
    backend and the trainer's recipe say: refuse a difference in ``ENGINE_FIELDS`` (it would pass the recipe check)."""
    if checkpoint is None or runtime is None:
        return
    diffs = [f"{k}: checkpoint={getattr(checkpoint, k)!r} engine={getattr(runtime, k)!r}" for k in ENGINE_FIELDS
             if _engine_value(checkpoint, k) != _engine_value(runtime, k)]
    if diffs:
        raise ValueError("the checkpoint's hf_quant_config.json 'trace' entry and the TraceConfig the engine was "
                         "started with (make_engine / register) differ in what the engine quantizes: "
                         + "; ".join(diffs) + ": the engine would serve the checkpoint's, the backend's recipe "
                         "says the other; start the engine with the checkpoint's TraceConfig, or export with this one")


def _engine_value(config: TraceConfig, field: str):
    """``config.field`` as the engine uses it: sites and exclude patterns are sets (named in any order, the same)."""
    v = getattr(config, field)
    return frozenset(v) if field in ("sites", "exclude_modules") else v


def _skipped(prefix: str, cfg: TraceQuantConfig) -> bool:
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    return is_layer_skipped(prefix, cfg.exclude_modules, cfg.packed_modules_mapping)


class TraceNvFp4LinearMethod(LinearMethodBase):
    """NVFP4 Linear: native ModelOpt kernels on Blackwell, else W4A4 emulation (dequantize, then GEMM)."""

    def __init__(self, quant_config: TraceQuantConfig):
        self.quant_config = quant_config
        self.native = ModelOptFp4LinearMethod(quant_config) if quant_config.native else None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        if self.native is not None:
            self.native.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                       output_size, params_dtype, **extra_weight_attrs)
        else:
            _create_linear_params(layer, input_size_per_partition, output_partition_sizes,
                                  extra_weight_attrs.get("weight_loader"))
        layer.register_parameter("weight_global_amax", _amax_param((len(output_partition_sizes),),
                                                                   extra_weight_attrs.get("weight_loader")))

    def process_weights_after_loading(self, layer) -> None:
        if self.native is not None:
            self.native.process_weights_after_loading(layer)

    def weight_fp4(self, layer) -> FP4Tensor:
        """The packed weight [N, K] with one amax per logical shard (expanded per row)."""
        amax = global_amax(layer.weight_global_amax, layer.weight_scale_2)  # [shards]
        rows = torch.tensor(layer.logical_widths, device=amax.device)
        g = amax.repeat_interleave(rows).unsqueeze(-1)  # [N, 1]
        return FP4Tensor(codes=layer.weight, block_scales=layer.weight_scale, global_amax=g,
                         shape=(layer.weight.shape[0], layer.weight.shape[1] * 2), fmt="nvfp4")

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.native is not None:
            return self.native.apply(layer, x, bias)
        xq = self.quant_config.trace.activation_quantizer(rollout=True).quantize(x).dequantize(x.dtype)
        return F.linear(xq, self.weight_fp4(layer).dequantize(x.dtype), bias)


def _create_linear_params(layer, k: int, output_partition_sizes: list[int], weight_loader) -> None:
    if k % 16:
        raise ValueError(f"NVFP4 Linear needs in_features % 16 == 0, got {k}")
    n = sum(output_partition_sizes)
    layer.logical_widths = output_partition_sizes
    layer.input_size_per_partition, layer.output_size_per_partition = k, n
    mw = lambda t: ModelWeightParameter(data=t, input_dim=1, output_dim=0, weight_loader=weight_loader)  # noqa: E731
    pt = lambda: PerTensorScaleParameter(data=torch.empty(len(output_partition_sizes), dtype=torch.float32),  # noqa: E731
                                         weight_loader=weight_loader)
    layer.register_parameter("weight", mw(torch.empty(n, k // 2, dtype=torch.uint8)))
    layer.register_parameter("input_scale", pt())
    layer.register_parameter("weight_scale_2", pt())
    layer.register_parameter("weight_scale", mw(torch.empty(n, k // 16, dtype=torch.float8_e4m3fn)))


class TraceModelOptNvFp4MoEMethod(ModelOptNvFp4FusedMoEMethod):
    """Routed experts in NVFP4 (see the module docstring). Parameter names and shapes = ModelOpt's."""

    def __init__(self, quant_config: TraceQuantConfig):
        self.quant_config = quant_config
        self.native = quant_config.native
        if self.native:
            super().__init__(quant_config)

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        if not self.native:
            check_emulated_moe_parallel(self.quant_config.trace, getattr(layer, "moe_tp_size", 1),
                                        getattr(layer, "moe_ep_size", 1))
            check_emulated_runner(get_moe_runner_backend().value)
        if self.native:
            super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                                   **extra_weight_attrs)
        else:
            create_moe_params(layer, num_experts, hidden_size, intermediate_size_per_partition,
                              extra_weight_attrs.get("weight_loader"), layer.moe_runner_config.is_gated)
        loader = make_amax_loader(layer)
        shards = 2 if layer.moe_runner_config.is_gated else 1
        layer.register_parameter("w13_weight_global_amax", _amax_param((num_experts, shards), loader))
        layer.register_parameter("w2_weight_global_amax", _amax_param((num_experts,), loader))

    def create_moe_runner(self, layer, moe_runner_config) -> None:
        self.moe_runner_config = moe_runner_config
        if self.native:
            super().create_moe_runner(layer, moe_runner_config)

    def process_weights_after_loading(self, layer) -> None:
        if self.native:
            super().process_weights_after_loading(layer)
            native_path.prepare_layer(layer)

    def apply(self, layer, dispatch_output):
        if self.native:  # UNVERIFIED (native.py): SGLang's kernels; fc1 input recorded from its quantize op
            if getattr(dispatch_output, "hidden_states_scale", None) is None:  # else already FP4 from dispatch
                native_path.record_fc1_input(active_capture(), layer, dispatch_output.hidden_states)
            return super().apply(layer, dispatch_output)
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        topk = dispatch_output.topk_output
        res = self.emulated_forward(layer, dispatch_output.hidden_states, topk.topk_ids, topk.topk_weights)
        return StandardCombineInput(hidden_states=res.out)

    def emulated_forward(self, layer, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """The W4A4-emulated experts on the layer's packed weights; records guidance. Returns ExpertsOutput."""
        cfg = self.moe_runner_config
        if cfg.activation != "silu" or not cfg.is_gated or cfg.apply_router_weight_on_input:
            raise ValueError(f"emulated TRACE MoE supports gated silu experts only, got activation={cfg.activation!r} "
                             f"is_gated={cfg.is_gated} apply_router_weight_on_input={cfg.apply_router_weight_on_input}")
        trace = self.quant_config.trace
        res = w4a4_experts_forward(
            hidden, topk_ids.long(), topk_weights, moe_packed(layer, "w13"), moe_packed(layer, "w2"),
            activation_quantizer=trace.activation_quantizer(rollout=True),
            quantize_fc1=trace.quantizes("expert_fc1_in"), quantize_fc2=trace.quantizes("expert_fc2_in"),
            apply_gate=silu_and_mul,
        )
        cap = active_capture()
        if cap is not None:
            for site, q in (("expert_fc1_in", res.fc1_in), ("expert_fc2_in", res.fc2_in)):
                if q is not None:
                    cap.record(layer.layer_id, site, q)
        return res


def create_moe_params(layer, e: int, h: int, f: int, weight_loader, gated: bool = True) -> None:
    """ModelOpt NVFP4 FusedMoE parameters (names, shapes, dtypes as SGLang's ModelOpt method), no swizzle."""
    shards = 2 if gated else 1
    mw = lambda t: ModelWeightParameter(data=t, input_dim=1, output_dim=2, weight_loader=weight_loader)  # noqa: E731
    pt = lambda *s: PerTensorScaleParameter(data=torch.empty(*s, dtype=torch.float32),  # noqa: E731
                                            weight_loader=weight_loader)
    layer.register_parameter("w13_weight", mw(torch.empty(e, shards * f, h // 2, dtype=torch.uint8)))
    layer.register_parameter("w2_weight", mw(torch.empty(e, h, f // 2, dtype=torch.uint8)))
    layer.register_parameter("w13_weight_scale", mw(torch.empty(e, shards * f, h // 16, dtype=torch.float8_e4m3fn)))
    layer.register_parameter("w2_weight_scale", mw(torch.empty(e, h, f // 16, dtype=torch.float8_e4m3fn)))
    layer.register_parameter("w13_weight_scale_2", pt(e, shards) if gated else pt(e))
    layer.register_parameter("w2_weight_scale_2", pt(e))
    w13_in, w2_in = pt(layer.num_experts, shards), pt(layer.num_experts)
    w13_in._sglang_require_global_experts = w2_in._sglang_require_global_experts = True
    layer.register_parameter("w13_input_scale", w13_in)
    layer.register_parameter("w2_input_scale", w2_in)


def moe_packed(layer, which: str) -> PackedExperts:
    """``w13`` [E, 2F, H] (amax per row from the per-shard amax) or ``w2`` [E, H, F] as PackedExperts."""
    codes, scales = getattr(layer, f"{which}_weight"), getattr(layer, f"{which}_weight_scale")
    amax = global_amax(getattr(layer, f"{which}_weight_global_amax"), getattr(layer, f"{which}_weight_scale_2"))
    if which == "w13":
        rows = codes.shape[1] // amax.shape[1]
        amax = amax.repeat_interleave(rows, dim=1)  # [E, 2F]
    return PackedExperts(codes=codes, block_scales=scales, global_amax=amax, k=codes.shape[2] * 2)


def make_amax_loader(layer):
    """Weight loader for ``*_weight_global_amax`` with FusedMoE.weight_loader's signature."""

    def load(param, loaded_weight, weight_name: str, shard_id: str, expert_id: int) -> None:
        start = getattr(layer, "moe_ep_rank", 0) * param.shape[0]
        local = expert_id - start
        if not 0 <= local < param.shape[0]:
            return  # another EP rank's expert
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"{weight_name}: shard_id={shard_id!r} is not one of w1, w2, w3")
        with torch.no_grad():
            value = loaded_weight.reshape(()).to(param.device, torch.float32)
            if shard_id == "w2":
                param.data[local] = value
            else:
                param.data[local, 0 if shard_id == "w1" or param.dim() == 1 else 1] = value

    return load
