"""Faster paths for the FP4 ops: Triton twins of ``formats`` (bit-exact) and the FP4-weight MoE GEMM.

Public API: ``Kernel`` / ``select_kernel`` / ``triton_available`` (selection), ``quantize``,
``quantize_and_record``, ``guided_quantize``, ``fake_quantize``, ``dequantize``, ``compact_guidance``,
``abs_max`` (``ops``), ``fp4_grouped_mm`` and its reference ``grouped_mm_reference`` (``moe``).
Importing this package never imports Triton.
"""

from .dispatch import KERNELS, Kernel, parse_kernel, select_kernel, triton_available
from .moe import fp4_grouped_mm, grouped_mm_reference
from .ops import abs_max, compact_guidance, dequantize, fake_quantize, guided_quantize, quantize, quantize_and_record

__all__ = [
    "KERNELS", "Kernel", "abs_max", "compact_guidance", "dequantize", "fake_quantize", "fp4_grouped_mm",
    "grouped_mm_reference", "guided_quantize", "parse_kernel", "quantize", "quantize_and_record", "select_kernel",
    "triton_available",
]
