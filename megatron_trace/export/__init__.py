"""Export of trained policies for inference engines (``modelopt``: ModelOpt-style NVFP4 checkpoints)."""

from .modelopt import (
    build_modelopt_state,
    fc1_from_modelopt,
    fp4_from_modelopt,
    load_modelopt_state,
    modelopt_linear_tensors,
    quant_config_dict,
    save_modelopt_checkpoint,
)

__all__ = [
    "build_modelopt_state", "fc1_from_modelopt", "fp4_from_modelopt", "load_modelopt_state",
    "modelopt_linear_tensors", "quant_config_dict", "save_modelopt_checkpoint",
]
