"""Format objects by name (``"nvfp4"``, ``"mxfp4"``)."""

from __future__ import annotations

FORMATS = ("nvfp4", "mxfp4")


def get_format(name: str, scale_rule: str = "floor"):
    """The scale-policy object of format ``name``; ``scale_rule`` applies to MXFP4 only."""
    if name == "nvfp4":
        from .nvfp4 import FORMAT

        return FORMAT
    if name == "mxfp4":
        from .mxfp4 import MXFP4Format

        return MXFP4Format(scale_rule)
    raise ValueError(f"format={name!r} is not one of {FORMATS}")
