"""Test-only helpers for the bridge tests: Megatron on CPU (gloo) via megatron_trace.testing.megatron_cpu."""

from __future__ import annotations

import torch

from megatron_trace.testing.megatron_cpu import (  # noqa: F401  (re-exported for the tests)
    apply_cpu_shims,
    free_port,
    init_megatron,
    shutdown_megatron,
    spawn_ranks,
)


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-sequence causal forward of a GPTModel: tokens [B, S] -> logits [B, S, V]."""
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True = masked
    with torch.no_grad():
        return model(tokens, pos, mask)
