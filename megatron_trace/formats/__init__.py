"""The pure-PyTorch reference of the FP4 formats: the specification every faster path must match.

Public API (stable): ``e2m1``, ``nvfp4.quantize``/``guided_quantize``, ``mxfp4.quantize``/
``guided_quantize``, ``FP4Tensor`` (alias ``NVFP4Tensor``), ``FullGuidance``, ``CompactGuidance``,
``Quantizer``, ``fake_quantize``, ``rounding``.
"""

from . import e2m1, mxfp4, nvfp4, rounding
from .constants import E2M1_MAX, E4M3_MAX, MXFP4_BLOCK, NVFP4_BLOCK
from .quantizer import Quantizer, fake_quantize
from .registry import FORMATS, RECORD_FORMATS, get_format
from .tensor import CompactGuidance, FP4Tensor, FullGuidance, GuidanceMismatchError, NonFiniteError

NVFP4Tensor = FP4Tensor

__all__ = [
    "CompactGuidance", "E2M1_MAX", "E4M3_MAX", "FORMATS", "FP4Tensor", "FullGuidance", "GuidanceMismatchError",
    "MXFP4_BLOCK", "NVFP4Tensor", "NVFP4_BLOCK", "NonFiniteError", "Quantizer", "RECORD_FORMATS", "e2m1",
    "fake_quantize", "get_format", "mxfp4", "nvfp4", "rounding",
]
