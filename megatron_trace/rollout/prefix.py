"""Prefix reuse inside one ``generate`` call: identical prompts are prefilled once, then forked.

GRPO samples G responses per prompt. The hf backend prefills each distinct prompt once (the batch of
distinct prompts, in first-appearance order), then copies the prefill's state row by row to every
sample: the KV cache rows (``FP4KVCache`` codes, scales and amax, or BF16 K/V), the routing and the
guidance records of the prompt positions, and the last-position logits. The records of a forked
sample are therefore, bit for bit, those of the K/V it decodes with (stored per KV slot, never
recomputed or left missing: USER_NEEDS.md §8), and equal to a cold prefill of the distinct prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .recorder import GuidanceRecorder


@dataclass(frozen=True)
class PrefixFork:
    """first: int64 [U], the row computing each distinct prompt; inverse: int64 [B], its distinct prompt."""

    first: torch.Tensor
    inverse: torch.Tensor

    @property
    def num_unique(self) -> int:
        return self.first.numel()


def shared_prompts(prompts: Sequence[Sequence[int]]) -> PrefixFork | None:
    """The fork plan of a batch, or None when every prompt is distinct (nothing to share)."""
    index: dict[tuple[int, ...], int] = {}
    first, inverse = [], []
    for b, p in enumerate(prompts):
        key = tuple(p)
        if key not in index:
            index[key] = len(first)
            first.append(b)
        inverse.append(index[key])
    if len(first) == len(prompts):
        return None
    return PrefixFork(torch.tensor(first, dtype=torch.long), torch.tensor(inverse, dtype=torch.long))


def fork_prefill(fork: PrefixFork, logits: torch.Tensor, cache: Cache, recorder: GuidanceRecorder) -> torch.Tensor:
    """Copy the distinct prompts' prefill state to every sample; returns the logits [B, V]."""
    inverse = fork.inverse.to(logits.device)
    cache.batch_select_indices(inverse)
    recorder.select_rows(inverse)
    return logits.index_select(0, inverse)
