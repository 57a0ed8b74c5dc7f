"""Rollout backends: the protocol (``base``) and the embedded transformers backend (``hf``)."""

from .base import RolloutBackend, RolloutBatch, SamplingParams
from .hf import HFRolloutBackend

__all__ = ["HFRolloutBackend", "RolloutBackend", "RolloutBatch", "SamplingParams"]
