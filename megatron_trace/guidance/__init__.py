"""Guidance: layer selection, records, host/disk cache, distributed sync, byte accounting, planner."""

from .accounting import bytes_per_layer, bytes_per_token, row_bytes
from .cache import GuidanceCache
from .layout import PackedLayout
from .model_dims import ModelDims
from .planner import budget_layers
from .records import SampleGuidance, SiteRecord, assemble, split_batch, staleness_stats, token_hash
from .selection import guided_layers
from .shards import ShardError
from .site import FallbackCounter, SiteGuidance, SiteKey
from .sync import GuidanceSync, GuidanceSyncError

__all__ = [
    "FallbackCounter", "GuidanceCache", "GuidanceSync", "GuidanceSyncError", "ModelDims", "PackedLayout",
    "SampleGuidance", "ShardError", "SiteGuidance", "SiteKey", "SiteRecord", "assemble", "budget_layers",
    "bytes_per_layer", "bytes_per_token", "guided_layers", "row_bytes", "split_batch", "staleness_stats", "token_hash",
]
