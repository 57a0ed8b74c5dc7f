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
from ...formats import sglang_kvfp4
from ...guidance.model_dims import ModelDims
from ...guidance.selection import guided_layers
from ...manifest import (
    KV_SITES,
    check_guided_layers,
    excluded_modules,
    experts_name,
    kv_cache_name,
    module_excluded,
)
from ..audit import sglang_moe_layers
from ..base import is_int
from .capture import ATTENTION_TARGET, LOGITS_TARGET
from .native import native_fp4_available
from .records import SiteSpec

logger = logging.getLogger(__name__)

CAPTURE_HOOK = "megatron_trace.rollout.sglang.capture:make_logits_hook"
ATTENTION_HOOK = "megatron_trace.rollout.sglang.capture:make_attention_hook"
WEIGHT_LOADER = "megatron_trace.rollout.sglang.weights.load_and_postprocess"
METHOD_NAME = "trace_nvfp4"
"""The TRACE quantization method's name in SGLang (``--quantization trace_nvfp4``)."""


SGLANG_EXTRA_HINT = ("SGLang is not installed: pip install 'megatron_trace[sglang]' (SGLang 0.5.10.post1; its "
                     "kernels need a CUDA GPU and torch 2.9.1)")


def require_sglang() -> None:
    """Raise a clear ImportError naming the extra when SGLang is absent (at the point of use)."""
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        raise ImportError(SGLANG_EXTRA_HINT) from e


def register(trace_config: TraceConfig | dict | None = None) -> None:
    """Make ``--quantization trace_nvfp4`` known to SGLang in this process (idempotent).

    The method is put first in ``QUANTIZATION_METHODS`` so that its ``override_quantization_method``
    keeps ``trace_nvfp4`` for ModelOpt NVFP4 checkpoints (ModelOpt's own override would switch them
    to ``modelopt_fp4``), and its Linear method joins ``WEIGHT_LOADER_V2_SUPPORTED`` (chosen by class name).
    """
    require_sglang()
    from sglang.srt.layers import linear
    from sglang.srt.layers import quantization as q
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    from .quant import TraceNvFp4LinearMethod, TraceQuantConfig, set_runtime_config

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
    if TraceNvFp4LinearMethod.__name__ not in linear.WEIGHT_LOADER_V2_SUPPORTED:  # (its parameters are v2's)
        linear.WEIGHT_LOADER_V2_SUPPORTED.append(TraceNvFp4LinearMethod.__name__)


def run_scheduler_process(*args, trace_config: dict | None = None, **kwargs):
    """SGLang's ``run_scheduler_process`` with ``register(trace_config)`` first (same signature + kw)."""
    register(trace_config)
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    return sglang_run(*args, **kwargs)


KV_FP4 = "fp4_e2m1"
EMULATED_RUNNERS = ("auto", "triton")
"""``--moe-runner-backend`` values under which SGLang's FusedMoE loads w13 as [gate; up], unpadded, untransposed
(the emulated MoE's layout)."""


def check_emulated_runner(backend: str) -> None:
    """The emulated MoE reads w13 as [gate; up] rows; other runners make FusedMoE load it otherwise
    (flashinfer_cutlass: up first; flashinfer_trtllm*: w1/w3 swapped, F padded; triton_kernel: transposed)."""
    if backend not in EMULATED_RUNNERS:
        raise ValueError(f"the emulated TRACE MoE (capability < 10) needs moe_runner_backend in {EMULATED_RUNNERS}, "
                         f"got {backend!r}: SGLang's FusedMoE loads the expert weights in that runner's layout")


def check_serves_fp4_weights(trace_config: TraceConfig) -> None:
    """A TRACE engine (``quantization="trace_nvfp4"``) serves the NVFP4 checkpoint's expert weights in FP4 whatever
    the config says: a config that does not quantize ``weights`` (a disabled one, a KV-only one) would have the
    trainer compute BF16 expert weights against them, a mismatch no record or recipe field shows."""
    if not trace_config.quantizes("weights"):
        raise ValueError(f"TraceConfig(enabled={trace_config.enabled}, sites={trace_config.sites}) does not quantize "
                         "'weights', but a TRACE engine (quantization='trace_nvfp4') serves the NVFP4 checkpoint's "
                         "expert weights in FP4 whatever the config says: enable the config with 'weights' in its "
                         "sites, or serve the BF16 checkpoint with a stock SGLang engine (no trace_nvfp4)")


def check_serves_format(trace_config: TraceConfig) -> None:
    """A TRACE engine quantizes in NVFP4 only (``TraceQuantConfig`` refuses another format, but in the engine's
    scheduler process, once the engine is starting): refuse it before."""
    if trace_config.format != "nvfp4":
        raise ValueError(f"TraceConfig.format={trace_config.format!r}: a TRACE engine (quantization='trace_nvfp4') "
                         "serves NVFP4 checkpoints only (valid: 'nvfp4'); roll out another format with the hf backend")


def check_kv_sites(trace_config: TraceConfig, kv_dtype: str) -> None:
    """SGLang's FP4 KV cache stores K and V both in FP4: a config that quantizes one of ``kv_k`` / ``kv_v`` would have
    the trainer compute the other in BF16 against the engine's FP4 values, while both recipes list the same sites."""
    if kv_dtype != KV_FP4:
        return
    kv = [s for s in KV_SITES if trace_config.quantizes(s)]
    if len(kv) == 1:
        other = next(s for s in KV_SITES if s != kv[0])
        raise ValueError(f"TraceConfig.sites={trace_config.sites} quantizes {kv[0]!r} but not {other!r}, while "
                         f"SGLang's FP4 KV cache (kv_cache_dtype={KV_FP4!r}) stores K and V both in FP4: the trainer "
                         f"would compute {other} in BF16 against the engine's FP4 values; quantize both "
                         f"{list(KV_SITES)} or neither")


def check_kv_override(trace_config: TraceConfig, kv_dtype: str) -> None:
    """A ``kv_cache_dtype`` override must serve the K/V the config computes: FP4 K/V where it quantizes KV sites,
    BF16 where it does not (the backend's recipe check refused either only once the engine had started)."""
    if (kv_dtype == KV_FP4) != (kv_cache_dtype(trace_config) == KV_FP4):
        kv = [s for s in KV_SITES if trace_config.quantizes(s)]
        raise ValueError(f"kv_cache_dtype={kv_dtype!r} stores {'FP4' if kv_dtype == KV_FP4 else 'BF16'} K/V, but "
                         f"TraceConfig.sites={trace_config.sites} quantizes {kv or 'no KV site'}: a trainer with this "
                         f"config would compute other K/V than the engine; drop the override (this config takes "
                         f"kv_cache_dtype={kv_cache_dtype(trace_config)!r}) or change the config's KV sites")


def needs_routing(trace_config: TraceConfig, specs: list[SiteSpec]) -> bool:
    """Whether the engine must return the routed experts: routing replay, or expert_fc2_in records (their rows are
    per (token, selected expert): the trainer matches them by expert id, replay or not, as from the hf backend)."""
    return trace_config.routing_replay or any(s.site == "expert_fc2_in" for s in specs)


def check_emulated_moe_parallel(trace_config: TraceConfig, moe_tp_size: int, moe_ep_size: int = 1) -> None:
    """The emulated MoE runs every expert on each rank (expert parallel size 1), and with MoE tensor parallelism
    each rank would hold an F/tp shard of every expert: it would quantize expert_fc2_in rows with an amax over the
    shard, not over the full row as the trainer and the hf backend do. SGLang's MoE TP size is
    ``tp_size // ep_size // moe_dp_size``."""
    if int(moe_ep_size) != 1:
        raise ValueError(f"the emulated TRACE MoE (capability < 10) supports expert parallel size 1 (ep_size=1), got "
                         f"{moe_ep_size}")
    if int(moe_tp_size) != 1 and trace_config.quantizes("expert_fc2_in"):
        raise ValueError(f"the emulated TRACE MoE (capability < 10) quantizes expert_fc2_in rows whole: it needs MoE "
                         f"tensor parallel size 1 (tp_size // moe_dp_size = 1), got {moe_tp_size}: each rank would "
                         f"quantize its F/{moe_tp_size} shard of a row with the shard's amax, not the full row's (as "
                         "the trainer)")


KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", KV_FP4)
"""SGLang ``kv_cache_dtype`` values a TRACE engine may run: the model's dtype (BF16 K/V, as a trainer without KV
sites computes them) or SGLang's FP4 KV cache (the trainer's KV sites, ``kv_format="sglang_kvfp4"``)."""


def check_kv_cache_dtype(kv_dtype: str) -> None:
    """Refuse a KV cache the trainer cannot compute: FP8 K/V (``fp8_e4m3`` / ``fp8_e5m2``) has no trainer site, no
    recipe field and no records, so it would be a silent train-rollout mismatch (USER_NEEDS.md §10)."""
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_dtype!r}: the trainer has no site for it, so K/V would differ between "
                         f"rollout and trainer unrecorded and unguided (FP8 KV: sglang#25790, uncalibrated scales of "
                         f"1.0); valid: {KV_CACHE_DTYPES} ({KV_FP4!r} with KV sites in the TraceConfig)")


def kv_cache_dtype(trace_config: TraceConfig) -> str:
    """SGLang's ``kv_cache_dtype`` for a TraceConfig: ``fp4_e2m1`` when it quantizes a KV site, else ``auto``."""
    return KV_FP4 if any(trace_config.quantizes(s) for s in KV_SITES) else "auto"


def guidance_specs(trace_config: TraceConfig, hf_config: dict, *, kv_dtype: str | None = None) -> list[SiteSpec]:
    """The (layer, site) rows the engine records: the layer policy's layers, less ``exclude_modules``.

    Expert sites: ``TraceConfig.format`` rows as the TRACE MoE method quantizes them. KV sites:
    SGLang's FP4 KV pool rows (``sglang_kvfp4``, only with ``kv_dtype == "fp4_e2m1"``)."""
    kv_dtype = kv_cache_dtype(trace_config) if kv_dtype is None else kv_dtype
    # (the layers and KV heads as transformers builds the model: Qwen3-MoE's rule for the MoE layers of a Qwen3.5-MoE
    # config dropped layers with experts, and a hybrid model's linear-attention layers, without a KV cache, got K/V
    # specs: ``accounting`` sized neither)
    dims = ModelDims.from_hf_config(hf_config)
    compact = trace_config.cache_mode == "compact"
    specs, layers = [], guided_layers(trace_config, dims.num_layers)
    check_guided_layers(trace_config, layers, moe_layers=dims.moe_layers,  # (guiding nothing: no spec, silently)
                        kv_layers=dims.kv_layers)
    # (a pattern naming a module the model lacks, e.g. a linear-attention layer's K/V cache, left every spec as it was)
    excluded_modules(trace_config, moe_layers=dims.moe_layers, attention_layers=dims.kv_layers)
    for layer in layers:
        for site in trace_config.guided_sites:
            if not trace_config.quantizes(site) or not dims.has_site(layer, site):
                continue
            if site in KV_SITES:
                if kv_dtype == KV_FP4 and not module_excluded(trace_config, kv_cache_name(layer)):
                    specs.append(SiteSpec(layer, site, dims.site_rows(site), sglang_kvfp4.NAME, compact))
            elif not module_excluded(trace_config, experts_name(layer)):
                shape = (dims.hidden,) if site == "expert_fc1_in" else (dims.topk, dims.moe_ffn)
                specs.append(SiteSpec(layer, site, shape, trace_config.format, compact))
    return specs


def hook_specs(specs: list[SiteSpec]) -> list[dict]:
    """``forward_hooks`` entries: the slot binding on every attention, the read-out on ``logits_processor``."""
    cfg = {"specs": [dict(layer=s.layer, site=s.site, row_shape=list(s.row_shape), fmt=s.fmt, compact=s.compact)
                     for s in specs]}
    return [{"name": "trace_slots", "target_modules": [ATTENTION_TARGET], "hook_factory": ATTENTION_HOOK,
             "config": cfg},
            {"name": "trace_readout", "target_modules": [LOGITS_TARGET], "hook_factory": CAPTURE_HOOK,
             "config": cfg}]


# what the slot capture cannot handle, checked after overrides: ServerArgs key -> (required value, why)
REQUIRED = {
    "disable_radix_cache": (False, "the read-out is a radix-cache hit on the finished request's KV slots"),
    "page_size": (1, "radix matches are page-aligned: a page_size > 1 remainder would be recomputed, not read"),
    "disable_piecewise_cuda_graph": (True, "extend forwards must run eagerly for the read-out hook"),
    "enable_torch_compile": (False, "the capture hooks and slot writes are not traced by torch.compile"),
    "enable_dp_attention": (False, "the MoE sees other DP ranks' tokens: rows do not match this rank's slots"),
    "speculative_algorithm": (None, "draft/verify forwards are not supported by the capture"),
    "pp_size": (1, "only the last pipeline stage runs the read-out (logits_processor), and its slot buffers hold "
                   "the rows of its own layers only: an earlier stage's layers would be read out as zero rows"),
    "enable_hierarchical_cache": (False, "HiCache loads a host-tier prefix back into new KV slots without its "
                                         "guidance rows: the read-out would return other tokens' rows as valid"),
    "disaggregation_mode": ("null", "a prefill engine's read-out holds no decoded token's rows, and the decode engine "
                                    "runs without the radix cache the read-out hits"),
    "dp_size": (1, "SGLang's data-parallel controller sends each request, the read-out too, to a replica of its "
                   "choosing (round robin): the read-out misses the radix cache holding the finished request, or hits "
                   "another replica's forward of the same tokens"),
    "attn_cp_size": (1, "attention context parallelism splits each prefill's tokens over the CP ranks, and each "
                        "rank's MoE runs on its share: rank 0's slot buffers, which the read-out returns, lack the "
                        "other ranks' tokens"),
    "moe_dp_size": (1, "MoE data parallelism gives each MoE-DP rank a share of the tokens (SGLang pairs it with "
                       "attn_cp_size): rank 0's slot buffers, which the read-out returns, lack the other ranks' rows"),
    "enable_lmcache": (False, "LMCache loads a stored prefix's K/V back into new KV slots without its guidance rows "
                              "(the read-out would return other tokens' rows as valid), and keeps it across the radix "
                              "flush of a weight update"),
}


ATTENTION_BACKEND_KEYS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def check_capture_settings(server_args) -> None:
    """``REQUIRED`` on ServerArgs kwargs (a dict) or on an engine's resolved ``server_args``: SGLang's
    ``__post_init__`` may override what was asked, e.g. ``disable_radix_cache=True`` for
    ``disaggregation_mode="decode"`` or for deterministic inference on an attention backend without radix support,
    and an engine launched otherwise than by ``trace_server_args`` may differ anyway. A key absent is not checked."""
    get = server_args.get if isinstance(server_args, dict) else lambda k, d: getattr(server_args, k, d)
    missing = object()
    for key, (want, why) in REQUIRED.items():
        got = get(key, missing)
        if got is not missing and got != want:
            hint = ""
            if key == "page_size" and "trtllm_mha" in {get(k, None) for k in ATTENTION_BACKEND_KEYS}:
                hint = (" (SGLang's trtllm_mha attention backend, its default on Blackwell, takes pages of 16-64 "
                        "tokens: pass attention_backend='flashinfer' or 'triton' to trace_server_args)")
            raise ValueError(f"guidance capture needs {key}={want!r}, got {got!r}: {why}{hint}")


def check_sharded_capture(specs: list[SiteSpec], tp_size: int) -> None:
    """Guidance of ``expert_fc2_in`` or a KV site needs ``tp_size`` 1: each TP rank holds a shard of the FFN / of the
    KV heads and only rank 0's rows are returned (``expert_fc1_in`` rows are replicated over the TP ranks)."""
    sharded = sorted({s.site for s in specs if s.site != "expert_fc1_in"})
    if sharded and tp_size != 1:
        raise ValueError(f"guidance for {sharded} needs tp_size=1 (got {tp_size}): each TP rank holds a shard of the "
                         "FFN / KV heads and only rank 0's rows are returned")


PARALLEL_SIZES = ("tp_size", "ep_size", "pp_size", "dp_size", "moe_dp_size")
"""ServerArgs parallel sizes ``trace_server_args`` reads (1 when not given)."""


def check_parallel_sizes(kw: dict) -> None:
    """Each of ``PARALLEL_SIZES`` given is an int >= 1 (``ep_size=0`` divided by zero in the MoE TP size; a
    ``tp_size`` of 0 or -1 passed every check here and went to SGLang as given)."""
    bad = {k: kw[k] for k in PARALLEL_SIZES if k in kw and not (is_int(kw[k]) and kw[k] >= 1)}
    if bad:
        raise ValueError(f"parallel size(s) {bad} must be ints >= 1 (valid: 1, 2, ...; 1 when not given)")


def trace_server_args(model_path: str, trace_config: TraceConfig, hf_config: dict, *, native: bool | None = None,
                      **overrides) -> dict:
    """ServerArgs kwargs for a TRACE engine on a ModelOpt/TRACE NVFP4 checkpoint (see ``export.modelopt``).

    Chunked prefill and the radix cache stay on (the capture is per KV slot); CUDA graphs too on the
    native path (``native``: None = this process's device has capability >= 10). The emulated MoE
    (Hopper) host-syncs (routing bounds, per-expert counts, finiteness checks), so it needs
    ``disable_cuda_graph=True``, whatever the capture does. With guidance: ``REQUIRED`` settings, and
    ``tp_size == 1`` for ``expert_fc2_in``/KV sites (a TP rank holds a shard of the FFN and of the KV
    heads). KV sites in the config -> ``kv_cache_dtype=fp4_e2m1`` (SGLang's format, not
    ``TraceConfig.format``: see ``SGLangRolloutBackend.check_recipe``; one KV site alone is refused, as SGLang's
    FP4 KV cache stores K and V both). ``enable_return_routed_experts`` with routing replay or expert_fc2_in
    records (``needs_routing``).
    """
    check_serves_fp4_weights(trace_config)
    check_serves_format(trace_config)
    native = native_fp4_available() if native is None else native
    kv_dtype = overrides.get("kv_cache_dtype", kv_cache_dtype(trace_config))
    check_kv_cache_dtype(kv_dtype)
    check_kv_sites(trace_config, kv_dtype)
    check_kv_override(trace_config, kv_dtype)
    # (an exclude pattern matching none of the config's modules raises here, as in the backend, not after the start)
    excluded_modules(trace_config, moe_layers=sglang_moe_layers(hf_config),
                     attention_layers=range(int(hf_config["num_hidden_layers"])))
    specs = guidance_specs(trace_config, hf_config, kv_dtype=kv_dtype)
    kw = dict(model_path=model_path, quantization=METHOD_NAME, custom_weight_loader=[WEIGHT_LOADER],
              enable_return_routed_experts=needs_routing(trace_config, specs), kv_cache_dtype=kv_dtype)
    if not native:
        kw["disable_cuda_graph"] = True
    if kv_dtype == KV_FP4:
        kept = [i for i in range(int(hf_config["num_hidden_layers"]))
                if module_excluded(trace_config, kv_cache_name(i))]
        if kept:
            raise ValueError(f"TraceConfig.exclude_modules keeps the KV cache of layers {kept} in BF16, but SGLang's "
                             "fp4_e2m1 KV cache quantizes every layer")
        kw["attention_backend"] = "triton"  # one of SGLang's KV4 MHA backends (server_args._handle_kv4_compatibility)
    if specs:
        kw.update({k: v for k, (v, _) in REQUIRED.items()}, forward_hooks=hook_specs(specs))
    kw.update(overrides)
    check_parallel_sizes(kw)
    if not native and not kw.get("disable_cuda_graph"):
        raise ValueError("the emulated TRACE MoE (capability < 10) needs disable_cuda_graph=True: it synchronizes "
                         "with the host (routing bounds, per-expert counts, finiteness checks)")
    if not native:
        check_emulated_runner(kw.get("moe_runner_backend") or "auto")
        ep = kw.get("ep_size", 1)
        check_emulated_moe_parallel(trace_config, kw.get("tp_size", 1) // ep // kw.get("moe_dp_size", 1), ep)
    if specs:
        check_capture_settings(kw)
        check_sharded_capture(specs, kw.get("tp_size", 1))
    return kw


def make_engine(trace_config: TraceConfig, **server_kwargs):
    """An ``sglang.Engine`` whose scheduler processes register the TRACE method first."""
    register(trace_config)  # (raises naming the extra without SGLang)
    import sglang

    class TraceEngine(sglang.Engine):
        run_scheduler_process_func = staticmethod(
            functools.partial(run_scheduler_process, trace_config=trace_config.to_dict()))

    return TraceEngine(**server_kwargs)
