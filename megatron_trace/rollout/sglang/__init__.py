"""SGLang rollout backend (production path): TRACE quantization method, guidance capture, weight sync.

Importing this package needs no sglang; ``quant`` (the method) and ``launch.register``/``make_engine``
import it on use. See examples/sglang/README.md for how to launch it next to Megatron trainers.
"""

from .backend import SGLangRolloutBackend, decode_routing, sampling_dict
from .capture import READOUT_PREFIX, SlotCapture, kv_rows, make_attention_hook, make_logits_hook, readout_payloads
from .launch import (
    ATTENTION_HOOK,
    CAPTURE_HOOK,
    REQUIRED,
    WEIGHT_LOADER,
    guidance_specs,
    hook_specs,
    kv_cache_dtype,
    make_engine,
    register,
    run_scheduler_process,
    trace_server_args,
)
from .native import native_fp4_available
from .records import SiteSpec, assemble, decode_rows, encode_rows
from .weights import WeightsUpdateGroup, engine_tensors, load_and_postprocess

__all__ = [
    "ATTENTION_HOOK", "CAPTURE_HOOK", "READOUT_PREFIX", "REQUIRED", "SGLangRolloutBackend", "SiteSpec",
    "SlotCapture", "WEIGHT_LOADER", "WeightsUpdateGroup", "assemble", "decode_routing", "decode_rows",
    "encode_rows", "engine_tensors", "guidance_specs", "hook_specs", "kv_cache_dtype", "kv_rows",
    "load_and_postprocess", "make_attention_hook", "make_engine", "make_logits_hook", "native_fp4_available",
    "readout_payloads", "register", "run_scheduler_process", "sampling_dict", "trace_server_args",
]
