"""HF checkpoint directories <-> this rank's Megatron model(s), through ``Qwen3MoeBridge``: load, export, save.

Every rank calls each function (the bridge's scatters and gathers are collectives); the ranks agree on each step's
outcome (``agree``) so a failure on one rank raises on all of them.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..rollout.checkpoint_dir import StagedCheckpointDir
from ..rollout.hf_weights import DEFAULT_MAX_SHARD_BYTES, ShardedSafetensorsWriter
from .agree import agreed

if TYPE_CHECKING:
    from .qwen3_moe import LoadStats, Qwen3MoeBridge

logger = logging.getLogger(__name__)


def _as_list(models) -> list:
    return list(models) if isinstance(models, list | tuple) else [models]


def load_hf_checkpoint(models, path: str | os.PathLike, bridge: Qwen3MoeBridge, *, memory_efficient: bool = False
                       ) -> LoadStats:
    """Load a HF safetensors checkpoint directory into this rank's model(s), in place.

    Each rank reads only the tensors its parameters need (its own experts under EP), lazily
    per tensor; ``memory_efficient`` reads one tensor at a time instead of the rank's whole shard.
    """
    with torch.no_grad():
        bridge.load_weights(_as_list(models), os.fspath(path), memory_efficient=memory_efficient)
    logger.info("loaded %d tensors (%.1f MB) from %s", bridge.last_load_stats.tensors,
                bridge.last_load_stats.bytes / 1e6, path)
    return bridge.last_load_stats


@torch.no_grad()  # (as a decorator: gradients are off while the generator runs, not while it waits at a yield)
def export_hf_weights(models, bridge: Qwen3MoeBridge) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF checkpoint name, tensor) for the whole model; every rank must iterate (collectives).

    The caller's gradient mode is its own between the tensors: with a ``with torch.no_grad()`` around the yields,
    the caller ran with gradients off while the generator waited, and a consumer that stopped early (a sync that
    failed or timed out mid-stream) left them off for the training that followed until the generator was collected
    ("element 0 of tensors does not require grad" at its next backward)."""
    yield from bridge.export_weights(_as_list(models))


def save_hf_checkpoint(models, path: str | os.PathLike, bridge: Qwen3MoeBridge, *,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write a HF checkpoint directory (safetensors + config.json) from rank 0; all ranks must call (the export's
    gathers). Returns the weight files written (none on the other ranks).

    Rank 0 writes the tensors as the export yields them, into shards of at most ``max_shard_bytes`` named as
    transformers names them (``model-00001-of-00004.safetensors`` + ``model.safetensors.index.json``; a single
    shard is ``model.safetensors``). It holds one shard plus one tensor in host memory, never the model; the other
    ranks drop each gathered tensor as soon as the export made it (no host copy). config.json's ``dtype`` is the
    bridge's, the dtype of the tensors written (SGLang and vLLM with ``dtype="auto"`` serve a float32 config in
    float16).

    The directory is replaced as a whole (``StagedCheckpointDir``): rank 0 writes into a temporary sibling and
    renames it into place once every file is written and fsynced, so a save that fails midway leaves ``path``'s
    earlier checkpoint as it was (and removes the temporary directory). Files in ``path`` that are not checkpoint
    files (a README, tokenizer files) are kept; an earlier checkpoint's shards, index and ``hf_quant_config.json``
    are not. Under torch.distributed the ranks agree before the export (rank 0 made its directory) and after it
    (rank 0 wrote it), so a failure on rank 0 raises on every rank, a ``RuntimeError`` naming rank 0 and its cause
    on the others; rank 0 keeps joining the export's gathers after a write failed, so no rank is left in them. An
    agreement that itself fails (another rank's process died) removes rank 0's temporary directory too."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    drain = dist.is_initialized() and dist.get_world_size() > 1
    what = f"failed to save the checkpoint {os.fspath(path)}"
    made: list[StagedCheckpointDir] = []  # rank 0's, to remove if the agreement itself fails (a peer died)

    def prepare() -> tuple[StagedCheckpointDir, ShardedSafetensorsWriter] | None:
        if rank != 0:
            return None
        made.append(StagedCheckpointDir(path))
        return made[0], ShardedSafetensorsWriter(made[0].path, max_shard_bytes)

    try:
        prepared = agreed(prepare, what, RuntimeError)
    except BaseException:
        for staged in made:
            staged.abort()
        raise
    weights = export_hf_weights(models, bridge)

    def write() -> list[str]:
        if prepared is None:
            for _ in weights:  # the collectives only
                pass
            return []
        staged, writer = prepared
        with staged:
            with writer:
                _write_all(writer, weights, drain)
            config = copy.deepcopy(bridge.hf_config)
            config.dtype = bridge.dtype  # the tensors' dtype: engines run "auto" in it (a float32 config: in float16)
            config.save_pretrained(staged.path)
        logger.info("saved %d tensors (%.1f MB) to %s in %d file(s); at most %.1f MB held at once", writer.tensors,
                    writer.total_bytes / 1e6, path, len(writer.files), writer.peak_bytes / 1e6)
        return writer.files

    return agreed(write, what, RuntimeError)


def _write_all(writer: ShardedSafetensorsWriter, weights: Iterator[tuple[str, torch.Tensor]], drain: bool) -> None:
    """``writer.add`` every exported tensor. With ``drain``, a write that fails does not end the export: it goes on
    without writing (the other ranks wait in its gathers otherwise), and the error is raised at its end."""
    error = None
    for name, t in weights:
        if error is not None:
            continue
        try:
            writer.add(name, t)
        except Exception as e:
            if not drain:
                raise
            error = e
            logger.error("writing %s to %s failed (%s: %s); finishing the export's gathers without writing so that "
                         "every rank learns of it", name, writer.directory, type(e).__name__, e)
    if error is not None:
        raise error
