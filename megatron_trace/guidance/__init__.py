"""Guidance: layer selection, records, host/disk cache, distributed sync, byte accounting, planner."""

from .selection import guided_layers
from .site import FallbackCounter, SiteGuidance, SiteKey

__all__ = ["FallbackCounter", "SiteGuidance", "SiteKey", "guided_layers"]
