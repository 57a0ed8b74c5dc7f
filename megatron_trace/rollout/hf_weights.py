"""HF checkpoint names of a Qwen3-MoE model and the FP4 expert-weight split/join.

On disk (and on the weight-sync wire) routed experts are per expert:
``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``; in a transformers model they are
fused: ``gate_up_proj`` [E, 2*ffn, hidden] (gate rows first) and ``down_proj`` [E, hidden, ffn].
An expert's fc1 = [gate; up] is quantized as one matrix (Megatron's ``linear_fc1``: one global
amax); shipped in FP4 it is split by rows into gate and up parts that share that amax.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from ..formats import FP4Tensor

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def parse_expert_name(name: str) -> tuple[int, int, str] | None:
    """``(layer, expert, "gate_proj"|"up_proj"|"down_proj")`` for a routed-expert weight name, else None."""
    m = _EXPERT.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
"""transformers' fused expert parameters ([E, ...]); on disk and on the wire experts are per expert."""


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under their HF checkpoint names (experts split per expert), as views."""
    for name, t in model.state_dict().items():
        m = FUSED_EXPERTS.match(name)
        if m is None:
            yield name, t
            continue
        layer, which = m.groups()
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(t.shape[0]):
            if which == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up


def _rows(q: FP4Tensor, start: int, stop: int) -> FP4Tensor:
    if q.global_amax is not None and q.global_amax.dim():
        raise ValueError("expert weights have one global amax per matrix; got a per-row global_amax")
    return dataclasses.replace(
        q, codes=q.codes[start:stop], block_scales=q.block_scales[start:stop], shape=(stop - start, *q.shape[1:])
    )


def split_fc1(q: FP4Tensor) -> tuple[FP4Tensor, FP4Tensor]:
    """fc1 [2*ffn, hidden] -> (gate [ffn, hidden], up [ffn, hidden]) sharing the global amax."""
    rows = q.shape[0]
    if q.codes.dim() != 2 or rows % 2:
        raise ValueError(f"fc1 must be a 2-D FP4 tensor with an even number of rows, got shape {q.shape}")
    return _rows(q, 0, rows // 2), _rows(q, rows // 2, rows)


def join_fc1(gate: FP4Tensor, up: FP4Tensor) -> FP4Tensor:
    """Inverse of ``split_fc1``; the two halves must share format, K and global amax."""
    if gate.fmt != up.fmt or gate.shape[1:] != up.shape[1:]:
        raise ValueError(f"gate {gate.fmt} {gate.shape} and up {up.fmt} {up.shape} do not form one fc1 matrix")
    if (gate.global_amax is None) != (up.global_amax is None) or (
        gate.global_amax is not None and not torch.equal(gate.global_amax, up.global_amax)
    ):
        raise ValueError("gate and up halves of an FP4 fc1 weight must share one global amax (quantize [gate; up] "
                         "as one matrix, as Megatron's linear_fc1)")
    scales = torch.cat([gate.block_scales.view(torch.uint8), up.block_scales.view(torch.uint8)]).view(
        gate.block_scales.dtype)
    return dataclasses.replace(gate, codes=torch.cat([gate.codes, up.codes]), block_scales=scales,
                               shape=(gate.shape[0] + up.shape[0], *gate.shape[1:]))


def clear_weight_files(directory) -> list[str]:
    """Delete the safetensors weights (``model*.safetensors``) and index of an earlier checkpoint in
    ``directory`` before a new one is written there (a stale index would make loaders read the old shards);
    returns the names removed."""
    d = Path(directory)
    stale = sorted(p for p in [*d.glob("model*.safetensors"), d / "model.safetensors.index.json"] if p.is_file())
    for p in stale:
        p.unlink()
    if stale:
        logger.warning("%s: removed %d weight file(s) of an earlier checkpoint: %s", d, len(stale),
                       [p.name for p in stale][:5])
    return [p.name for p in stale]
