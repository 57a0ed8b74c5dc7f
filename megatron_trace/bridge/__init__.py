"""Megatron <-> HF weights (``qwen3_moe``, via mbridge; ``checkpoint``: load / export / save) and weight sync to the
rollout (``sync``).

``sync`` and ``config`` import nothing of Megatron at import time; ``qwen3_moe`` needs
megatron-core and mbridge and is imported (with ``checkpoint``) on first use of their names.
"""

from .config import build_gpt_model, gpt_model_kwargs, local_layer_spec, transformer_config_from_hf
from .sync import SyncStats, WeightSyncError, WeightSyncTimeoutError, fp4_stream, sync_byte_counts, sync_weights

_LAZY = {"LoadStats": "qwen3_moe", "Qwen3MoeBridge": "qwen3_moe", "export_hf_weights": "checkpoint",
         "load_hf_checkpoint": "checkpoint", "save_hf_checkpoint": "checkpoint"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SyncStats", "WeightSyncError", "WeightSyncTimeoutError",
    "build_gpt_model", "fp4_stream", "gpt_model_kwargs", "local_layer_spec", "sync_byte_counts",
    "sync_weights", "transformer_config_from_hf", *_LAZY,
]
