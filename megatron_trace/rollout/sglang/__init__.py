"""SGLang rollout backend (production path): TRACE quantization method, guidance capture, weight sync.

Importing this package needs no sglang; ``quant`` (the method) and ``launch.register``/``make_engine``
import it on use. See examples/sglang/README.md for how to launch it next to Megatron trainers.
"""

from .backend import SGLangRolloutBackend, decode_routing, sampling_dict
from .capture import GuidanceCapture, make_logits_hook
from .launch import (
    CAPTURE_HOOK,
    WEIGHT_LOADER,
    guidance_specs,
    make_engine,
    register,
    run_scheduler_process,
    trace_server_args,
)
from .records import SiteSpec, assemble, decode_rows, encode_rows
from .weights import WeightsUpdateGroup, engine_tensors, load_and_postprocess

__all__ = [
    "CAPTURE_HOOK", "GuidanceCapture", "SGLangRolloutBackend", "SiteSpec", "WEIGHT_LOADER", "WeightsUpdateGroup",
    "assemble", "decode_routing", "decode_rows", "encode_rows", "engine_tensors", "guidance_specs",
    "load_and_postprocess", "make_engine", "make_logits_hook", "register", "run_scheduler_process",
    "sampling_dict", "trace_server_args",
]
