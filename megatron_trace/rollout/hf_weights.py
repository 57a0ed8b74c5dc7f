"""HF checkpoint names of a Qwen3-MoE model and the FP4 expert-weight split/join.

On disk (and on the weight-sync wire) routed experts are per expert:
``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``; in a transformers model they are
fused: ``gate_up_proj`` [E, 2*ffn, hidden] (gate rows first) and ``down_proj`` [E, hidden, ffn].
An expert's fc1 = [gate; up] is quantized as one matrix (Megatron's ``linear_fc1``: one global
amax); shipped in FP4 it is split by rows into gate and up parts that share that amax.
Checkpoint files: ``ShardedSafetensorsWriter`` (transformers' shard names and index), written into a
``checkpoint_dir.StagedCheckpointDir`` that replaces the directory as a whole.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from ..formats import FP4Tensor, NonFiniteError
from .base import check_count, nonfinite_names

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""transformers' ``save_pretrained`` default shard size ("5GB")."""
_PARTIAL = ".partial"

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


class ShardedSafetensorsWriter:
    """Write tensors, as they come, into safetensors shards of at most ``max_shard_bytes`` each (a larger tensor gets
    a shard of its own), named as transformers' ``save_pretrained`` names them: ``model-00001-of-00003.safetensors``
    ... plus ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``);
    a single shard is ``model.safetensors`` without an index.

    Host memory: the shard being filled plus the tensor being added (``add`` copies it to the CPU; a full shard is
    written out and dropped before the next one fills). Shards are written as ``model-00001.safetensors.partial``
    and renamed by ``close()``, when their count is known. Write into an empty directory (the ``path`` of a
    ``checkpoint_dir.StagedCheckpointDir``: a stale index or shard of an earlier checkpoint would be read with the
    new ones); leaving a ``with`` block by an exception deletes the partial files written so far. ``metadata`` beyond
    ``"format"`` makes the shards' bytes vary between writes of the same tensors (safetensors writes its metadata keys
    in a random order).
    """

    def __init__(self, directory, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 metadata: dict[str, str] | None = None):
        self.max_shard_bytes = check_count("max_shard_bytes", max_shard_bytes)
        self.directory = Path(directory)
        if not self.directory.is_dir():  # (was: a SafetensorError at the first full shard, its data held till then)
            raise NotADirectoryError(f"safetensors shards go into an existing directory; {self.directory} "
                                     f"{'is a file' if self.directory.exists() else 'does not exist'}")
        self.metadata = {"format": "pt", **(metadata or {})}
        self.files: list[str] = []  # the final file names, after close()
        self.tensors = 0
        self.total_bytes = 0
        self.peak_bytes = 0  # the most tensor bytes held at once (the shard being filled + the tensor added)
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # (partial file, its tensor names)
        self._names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):  # (a bad name failed at the flush)
            raise TypeError(f"add(name, tensor) takes a str name and a torch.Tensor, got {name!r} and "
                            f"{type(tensor).__name__}")
        if name in self._names:
            raise ValueError(f"tensor {name!r} was already written to {self.directory}: names must be unique")
        if tensor.is_meta:  # (torch's "Cannot copy out of meta tensor", naming no weight)
            raise ValueError(f"tensor {name!r} is a meta tensor: it holds no values to write")
        t = tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)  # no storage shared with views
        n = t.numel() * t.element_size()
        self.peak_bytes = max(self.peak_bytes, self._shard_bytes + n)
        if self._shard and self._shard_bytes + n > self.max_shard_bytes:
            self._flush()
        # the name is taken once the tensor is held: an add that raised (its copy, or the flush of the full shard
        # before it) wrote nothing of it, and its retry was refused as "already written"
        self._names.add(name)
        self._shard[name] = t
        self._shard_bytes += n
        self.tensors += 1
        self.total_bytes += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f"model-{len(self._written) + 1:05d}.safetensors{_PARTIAL}"
        try:
            save_file(self._shard, path, metadata=self.metadata)
        except BaseException:  # (safetensors < 0.8 writes in place: a failed write left a truncated file abort missed)
            path.unlink(missing_ok=True)
            raise
        self._written.append((path, list(self._shard)))
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, give the shards their final names (and the index); returns the file names.

        All or nothing: where a rename or the index fails (a file or directory in the way), the shards renamed so far
        get their partial names back and the error is raised, the partial files left to ``abort`` (a ``with`` block
        aborts); a failure left the first shards under their final names, with no index, beside the partial rest."""
        if self._shard or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            files = [WEIGHTS_FILE]
        else:
            files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        renamed: list[tuple[Path, Path]] = []
        index = self.directory / (INDEX_FILE + _PARTIAL)
        try:
            for (partial, _), fname in zip(self._written, files):
                partial.replace(self.directory / fname)
                renamed.append((partial, self.directory / fname))
            if count > 1:
                weight_map = {n: fname for (_, names), fname in zip(self._written, files) for n in names}
                with open(index, "w") as f:
                    json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2,
                              sort_keys=True)
                index.replace(self.directory / INDEX_FILE)
        except BaseException:
            self._roll_back(renamed, index)
            raise
        self.files = files
        self._written = []
        return self.files

    def _roll_back(self, renamed: list[tuple[Path, Path]], index: Path) -> None:
        """Undo a failed ``close``: the renamed shards back to their partial names, the index's partial file gone."""
        for partial, final in reversed(renamed):
            try:
                final.replace(partial)
            except OSError as e:  # (abort then cannot find it: named, not dropped)
                logger.error("safetensors writer: could not rename %s back to %s after a failed close: %s", final,
                             partial, e)
        if index.is_file():
            index.unlink()

    def abort(self) -> None:
        """Delete the partial shards written so far (all of them after a failed ``close``)."""
        for partial, _ in self._written:
            partial.unlink(missing_ok=True)
        self._written, self._shard = [], {}

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:  # (close rolled its renames back: the partial files go too)
            self.abort()
            raise


def check_dense_updates(dense) -> None:
    """Refuse a dense update, (model tensor, value, name) triples, naming the weights: a value that is not a tensor,
    of another shape, or holding NaN/Inf, or doing so once in the model's dtype (a value beyond float16's range
    copies in as Inf; one host sync per device)."""
    for target, value, name in dense:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name!r}: expected a torch.Tensor or FP4Tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name!r}: shape {tuple(value.shape)} != the model's {tuple(target.shape)}")
        if value.is_meta:  # (was: "Cannot copy out of meta tensor; no data!")
            raise ValueError(f"{name!r}: a meta tensor holds no values")
        if target.is_floating_point() and not value.is_floating_point():  # (int codes were cast to float values)
            raise TypeError(f"{name!r}: {value.dtype} values for the model's {target.dtype} weight: give float values "
                            "(packed FP4 codes and scales as an FP4Tensor)")
    bad = nonfinite_names((name, value, target.dtype if target.is_floating_point() else None)
                          for target, value, name in dense)
    if bad:
        dtype = next(target.dtype for target, _, name in dense if name == bad[0])
        raise NonFiniteError(f"update_weights: {len(bad)} weight(s) hold NaN/Inf, e.g. {bad[:3]}; nothing was updated "
                             f"(checked as the model's {dtype}: a value beyond its range would copy in as Inf)")
