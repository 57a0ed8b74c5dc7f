"""Format objects by name: ``"nvfp4"`` and ``"mxfp4"`` (what TRACE quantizes with), and record-only formats
(``"sglang_kvfp4"``: SGLang's FP4 KV cache, which guidance records may carry but nothing quantizes with)."""

from __future__ import annotations

FORMATS = ("nvfp4", "mxfp4")
RECORD_FORMATS = (*FORMATS, "sglang_kvfp4")
"""Formats a guidance record may carry (``get_format`` knows them); a trainer accepts only its own."""


def get_format(name: str, scale_rule: str = "floor"):
    """The scale-policy object of format ``name`` (any of ``RECORD_FORMATS``); ``scale_rule`` applies to MXFP4."""
    if name == "nvfp4":
        from .nvfp4 import FORMAT

        return FORMAT
    if name == "mxfp4":
        from .mxfp4 import MXFP4Format

        return MXFP4Format(scale_rule)
    if name == "sglang_kvfp4":
        from .sglang_kvfp4 import FORMAT as SGLANG_KV

        return SGLANG_KV
    raise ValueError(f"format={name!r} is not one of {RECORD_FORMATS}")
