"""An FP4 KV cache for transformers: K/V stored as packed FP4, dequantized on read.

Rows are one token of one KV head (blocks along head_dim), quantized with the activation
quantizer (NVFP4: per-row global amax) after RoPE, i.e. exactly the K/V that attention reads.
Each ``update`` returns the whole dequantized history, the new tokens included, so a decode
step sees the same K/V as a full-sequence forward with fake-quantized K/V.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..formats import FP4Tensor, Quantizer
from .experts import fp4_nbytes
from .recorder import GuidanceRecorder, map_record


class _FP4Rows:
    """Packed FP4 rows of one of K or V, [B, kv_heads, T, ...], growing along T."""

    def __init__(self):
        self.chunks: list[FP4Tensor] = []
        self.length = 0

    def append(self, q: FP4Tensor) -> None:
        self.chunks.append(q)
        self.length += q.shape[2]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        # per-row scales: decoding chunk by chunk equals decoding the concatenation
        return torch.cat([q.dequantize(dtype) for q in self.chunks], dim=2)

    def nbytes(self) -> int:
        return sum(fp4_nbytes(q) for q in self.chunks)

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (int64 [B']; repeats fork a row)."""
        self.chunks = [select_rows(q, index) for q in self.chunks]


def select_rows(q: FP4Tensor, index: torch.Tensor) -> FP4Tensor:
    """Rows ``index`` of an FP4 tensor's leading (batch) dim: codes, scales and per-row amax alike."""
    scales = q.block_scales.view(torch.uint8).index_select(0, index).view(q.block_scales.dtype)
    amax = q.global_amax
    if amax is not None and amax.dim():
        amax = amax.index_select(0, index)
    return dataclasses.replace(q, codes=q.codes.index_select(0, index), block_scales=scales, global_amax=amax,
                               shape=(index.numel(), *q.shape[1:]))


class FP4KVLayer(DynamicLayer):
    """One attention layer's cache. ``quantize_k``/``quantize_v`` choose which of K, V is FP4
    (the other is kept in the model dtype). Records the rollout's rows for ``kv_k``/``kv_v``
    when a recorder is given."""

    def __init__(self, layer_idx: int, quantizer: Quantizer, *, quantize_k: bool = True, quantize_v: bool = True,
                 recorder: GuidanceRecorder | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.quantizer = quantizer
        self.quantize_k, self.quantize_v = quantize_k, quantize_v
        self.recorder = recorder
        self._rows: dict[str, _FP4Rows | list[torch.Tensor]] = {}
        self._length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = torch.tensor([], dtype=key_states.dtype, device=self.device)  # the history lives in _rows
        self.values = torch.tensor([], dtype=value_states.dtype, device=self.device)
        self._rows = {"kv_k": _FP4Rows() if self.quantize_k else [], "kv_v": _FP4Rows() if self.quantize_v else []}
        self._length = 0
        self.is_initialized = True

    def _store(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """x [B, kv_heads, t, head_dim] -> whole history [B, kv_heads, T, head_dim] (dequantized)."""
        rows = self._rows[site]
        if isinstance(rows, list):
            rows.append(x)
            return torch.cat(rows, dim=2)
        q = self.quantizer.quantize(x)
        rows.append(q)
        if self.recorder is not None:
            # record batch-major [B, t, kv_heads, ...]
            shape = (x.shape[0], x.shape[2], x.shape[1], x.shape[3])
            self.recorder.add_batch_major(
                self.layer_idx, site,
                lambda compact: map_record(q.guidance(compact), lambda t: t.transpose(1, 2).contiguous(), shape),
            )
        return rows.dequantize(x.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = self._store("kv_k", key_states)
        values = self._store("kv_v", value_states)
        self._length += key_states.shape[-2]
        return keys, values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def reset(self) -> None:
        self._rows, self._length = {}, 0
        super().reset()

    def nbytes(self) -> int:
        """Bytes held: FP4 payload of the quantized side(s) plus the unquantized tensors."""
        total = 0
        for rows in self._rows.values():
            total += rows.nbytes() if isinstance(rows, _FP4Rows) else sum(t.numel() * t.element_size() for t in rows)
        return total

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (or fork, with repeated indices) batch rows: the prefix reuse of ``generate``."""
        if not self.is_initialized:
            return
        index = torch.as_tensor(indices, dtype=torch.long, device=self.device)
        for site, rows in self._rows.items():
            if isinstance(rows, _FP4Rows):
                rows.select(index)
            else:
                self._rows[site] = [t.index_select(0, index) for t in rows]

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("FP4KVLayer supports prefill + decode and batch_select_indices only "
                                  "(no crop or beam reorder)")

    crop = batch_repeat_interleave = reorder_cache = _unsupported


class FP4KVCache(Cache):
    """A ``transformers`` Cache of ``FP4KVLayer`` (pass as ``cache=`` to the model)."""

    def __init__(self, num_layers: int, quantizer: Quantizer, *, quantize_k: bool = True, quantize_v: bool = True,
                 recorder: GuidanceRecorder | None = None, bf16_layers: frozenset[int] = frozenset()):
        """``bf16_layers``: layers whose K and V stay in the model dtype (``TraceConfig.exclude_modules``)."""
        layers = [FP4KVLayer(i, quantizer, quantize_k=quantize_k and i not in bf16_layers,
                             quantize_v=quantize_v and i not in bf16_layers, recorder=recorder)
                  for i in range(num_layers)]
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

