"""Registering the TRACE method in SGLang and launching an Engine with it.

SGLang has no plugin entry point: ``register()`` adds ``trace_nvfp4`` to its quantization registry
and CLI choices, in the calling process. Schedulers run in spawned processes, so the Engine must
start them through ``run_scheduler_process`` below (``TraceEngine`` / ``make_engine`` do), which
registers before SGLang builds the model config. Everything here imports sglang lazily.
"""

from __future__ import annotations

import functools
import logging

from ...config import TraceConfig
from ...guidance.selection import guided_layers
from .records import SiteSpec

logger = logging.getLogger(__name__)

CAPTURE_HOOK = "megatron_trace.rollout.sglang.capture:make_logits_hook"
WEIGHT_LOADER = "megatron_trace.rollout.sglang.weights.load_and_postprocess"


def register(trace_config: TraceConfig | dict | None = None) -> None:
    """Make ``--quantization trace_nvfp4`` known to SGLang in this process (idempotent).

    The method is put first in ``QUANTIZATION_METHODS`` so that its ``override_quantization_method``
    keeps ``trace_nvfp4`` for ModelOpt NVFP4 checkpoints (ModelOpt's own override would switch them
    to ``modelopt_fp4``).
    """
    from sglang.srt.layers import quantization as q
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    from .quant import METHOD_NAME, TraceQuantConfig, set_runtime_config

    if isinstance(trace_config, dict):
        trace_config = TraceConfig.from_dict(trace_config)
    set_runtime_config(trace_config)
    for registry in (q.QUANTIZATION_METHODS, q.BASE_QUANTIZATION_METHODS):
        if next(iter(registry), None) != METHOD_NAME:
            rest = [(k, v) for k, v in registry.items() if k != METHOD_NAME]
            registry.clear()
            registry[METHOD_NAME] = TraceQuantConfig
            registry.update(rest)
    if METHOD_NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([METHOD_NAME])


def run_scheduler_process(*args, trace_config: dict | None = None, **kwargs):
    """SGLang's ``run_scheduler_process`` with ``register(trace_config)`` first (same signature + kw)."""
    register(trace_config)
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    return sglang_run(*args, **kwargs)


def guidance_specs(trace_config: TraceConfig, hf_config: dict) -> list[SiteSpec]:
    """The (layer, site) rows the engine records, from the TraceConfig's layer policy and the HF config."""
    n = int(hf_config["num_hidden_layers"])
    hidden, ffn, topk = (int(hf_config[k]) for k in ("hidden_size", "moe_intermediate_size", "num_experts_per_tok"))
    shapes = {"expert_fc1_in": (hidden,), "expert_fc2_in": (topk, ffn)}
    compact = trace_config.cache_mode == "compact"
    skipped = [s for s in trace_config.guided_sites if s not in shapes]
    if skipped:
        logger.warning("SGLang backend records expert sites only; no guidance for %s (trainer falls back to RNE)",
                       skipped)
    return [SiteSpec(layer, site, shapes[site], trace_config.format, compact)
            for layer in guided_layers(trace_config, n) for site in trace_config.guided_sites
            if site in shapes and trace_config.quantizes(site)]


def trace_server_args(model_path: str, trace_config: TraceConfig, hf_config: dict, **overrides) -> dict:
    """ServerArgs kwargs for a TRACE engine on a ModelOpt/TRACE NVFP4 checkpoint (see ``export.modelopt``)."""
    specs = guidance_specs(trace_config, hf_config)
    kw = dict(model_path=model_path, quantization="trace_nvfp4", custom_weight_loader=[WEIGHT_LOADER],
              enable_return_routed_experts=trace_config.routing_replay)
    if specs:
        kw.update(disable_cuda_graph=True,  # the capture hook does not run inside a replayed graph
                  forward_hooks=[{"name": "trace_guidance", "target_modules": ["logits_processor"],
                                  "hook_factory": CAPTURE_HOOK,
                                  "config": {"specs": [dict(layer=s.layer, site=s.site, row_shape=list(s.row_shape),
                                                            fmt=s.fmt, compact=s.compact) for s in specs]}}])
    kw.update(overrides)
    if specs and not kw.get("disable_cuda_graph"):
        raise ValueError("guidance capture needs disable_cuda_graph=True (the hook is not replayed by CUDA graphs)")
    return kw


def make_engine(trace_config: TraceConfig, **server_kwargs):
    """An ``sglang.Engine`` whose scheduler processes register the TRACE method first."""
    import sglang

    register(trace_config)

    class TraceEngine(sglang.Engine):
        run_scheduler_process_func = staticmethod(
            functools.partial(run_scheduler_process, trace_config=trace_config.to_dict()))

    return TraceEngine(**server_kwargs)
