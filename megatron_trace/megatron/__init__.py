"""Megatron-Core plugin: FP4 QAT routed experts with guided rounding, the KV site, routing replay, flags.

Turn TRACE on by building the model with a TRACE spec (one call), e.g. in a model builder::

    spec = trace_spec(stock_spec, trace_config)          # any stock layer or block spec
    # or: get_trace_decoder_block_spec(trace_config, transformer_config)

and, per RL step, give the rollout's guidance::

    with trace_guidance(model, StepGuidance(sites=..., routing=...)) as h:
        ...forward and backward...

or, around Megatron's ``forward_backward_func`` (pipeline schedules included), one StepGuidance per micro-batch::

    with trace_guidance(model_chunks, [StepGuidance(...) for mb in micro_batches]) as h:
        forward_backward_func(..., num_microbatches=len(micro_batches))

Packed sequences (THD, one row per micro-batch): ``pack_step(step, cu_seqlens)`` lays a batch-major StepGuidance out
for the packed row; ``packed_layout(packed_seq_params)`` given to the assembly (``GuidanceCache.assemble(...,
layout=)``) builds the packed row's guidance directly.

Megatron-LM: ``add_trace_args`` (extra_args_provider) + ``trace_config_from_args``; see patches/.
"""

from ..formats import NonFiniteError
from .args import add_trace_args, trace_args_from_config, trace_config_from_args, trace_spec_from_args
from .attention import TraceDotProductAttention, TraceKVCore
from .context import StepGuidance, TraceStep, check_finite, trace_guidance, trace_record
from .experts import TraceExpertsCore, TraceSequentialMLP
from .layers import find_trace_layers
from .packing import pack_step, packed_layout
from .spec import TraceSpecProvider, get_trace_decoder_block_spec, get_trace_gpt_layer_spec, trace_spec
from .step import GuidanceCoverageError, GuidanceFallbackError
from .te import TE_EXTRA_HINT, TraceTEGroupedMLP, TraceWeightFetch
from .train_step import reuse_weight_quant, trace_eval_done, trace_eval_start, trace_train_step

__all__ = [
    "GuidanceCoverageError", "GuidanceFallbackError", "NonFiniteError",
    "StepGuidance", "TE_EXTRA_HINT", "TraceDotProductAttention",
    "TraceExpertsCore", "TraceKVCore", "TraceSequentialMLP", "TraceSpecProvider", "TraceStep", "TraceTEGroupedMLP",
    "TraceWeightFetch", "add_trace_args", "check_finite", "find_trace_layers", "get_trace_decoder_block_spec",
    "get_trace_gpt_layer_spec", "pack_step", "packed_layout", "reuse_weight_quant", "trace_args_from_config",
    "trace_config_from_args", "trace_eval_done", "trace_eval_start", "trace_guidance", "trace_train_step",
    "trace_record", "trace_spec", "trace_spec_from_args",
]
