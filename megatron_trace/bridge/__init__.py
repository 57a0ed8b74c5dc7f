"""Megatron <-> HF weights (``qwen3_moe``, via mbridge) and weight sync to the rollout (``sync``).

``sync`` and ``config`` import nothing of Megatron at import time; ``qwen3_moe`` needs
megatron-core and mbridge and is imported on first use of its names.
"""

from .config import build_gpt_model, gpt_model_kwargs, local_layer_spec, transformer_config_from_hf
from .sync import SyncStats, WeightSyncError, WeightSyncTimeoutError, fp4_stream, sync_byte_counts, sync_weights

_LAZY = ("LoadStats", "Qwen3MoeBridge", "export_hf_weights", "load_hf_checkpoint", "save_hf_checkpoint")


def __getattr__(name):
    if name in _LAZY:
        from . import qwen3_moe

        return getattr(qwen3_moe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SyncStats", "WeightSyncError", "WeightSyncTimeoutError",
    "build_gpt_model", "fp4_stream", "gpt_model_kwargs", "local_layer_spec", "sync_byte_counts",
    "sync_weights", "transformer_config_from_hf", *_LAZY,
]
