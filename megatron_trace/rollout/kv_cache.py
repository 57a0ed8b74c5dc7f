"""An FP4 KV cache for transformers: K/V stored as packed FP4, dequantized on read.

Rows are one token of one KV head (blocks along head_dim), quantized with the activation
quantizer (NVFP4: per-row global amax) after RoPE, i.e. exactly the K/V that attention reads.
Each ``update`` returns the whole dequantized history, the new tokens included, so a decode
step sees the same K/V as a full-sequence forward with fake-quantized K/V.

Storage: preallocated buffers [B, kv_heads, capacity, ...] that grow geometrically (a decode step
writes one token in place; no per-step copy of the history). On the Triton path a one-token update is one
quantize launch per K or V that writes the token's codes, scales and amax straight into the buffers
(``fused.quantize(out=)``); a prefill quantizes, then copies. A per-tensor global amax is stored
per row (the same value in every row of a chunk: dequantizes to the same bits). A recorder records the
``kv_k`` / ``kv_v`` sites of FP4 rows from this stored history when the rollout ends
(``GuidanceRecorder.add_kv_history``), SGLang's format per step. ``kernel``
(``TraceConfig.kernel``): on CUDA, "auto" quantizes and dequantizes with the Triton twins of
``formats`` (same bits as the reference).

``fused_decode=True``: a one-token update of a layer whose K and V are both FP4 stores the token but
skips dequantizing the history: it returns the new token's K/V [B, kv_heads, 1, head_dim] with the layer
attached as ``DEFERRED_ATTR``, and the attention that follows must read the packed history from it
(``rollout.attention``, the fused FP4-KV decode attention; ``HFRolloutBackend`` selects it).

``TraceConfig.kv_format="sglang_kvfp4"`` (``formats.sglang_kvfp4.SGLangKVQuantizer``): rows are stored and recorded in
SGLang's FP4 KV-cache format (``formats.sglang_kvfp4``, the reference path: no Triton, no fused decode; reads
dequantize the history for SDPA), so the records guide a trainer with the same ``kv_format``.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..formats import FP4Tensor, Quantizer
from ..formats.sglang_kvfp4 import SGLangKVQuantizer
from ..kernels import Kernel, select_kernel
from ..kernels import dequantize as kernel_dequantize
from ..kernels import quantize as kernel_quantize
from ..kernels.checks import FiniteCounter, read_and_reset
from ..kernels.kv_attention import ROW_ALIGN  # capacities in multiples of it: the attention's aligned loads
from .recorder import GuidanceRecorder

KVQuantizer = Quantizer | SGLangKVQuantizer
"""``TraceConfig.kv_quantizer()``: the activation quantizer, or SGLang's KV format (``kv_format``)."""

DEFERRED_ATTR = "_trace_fp4_kv_layer"
"""Attribute of the key tensor a deferred decode update returns: the ``FP4KVLayer`` holding the history."""

MIN_GROWTH = 256
"""Extra token slots allocated when a buffer grows (at least; else an eighth of the length)."""


class _Growing:
    """Named tensors [B, kv_heads, T, ...] stored in buffers with spare capacity along T."""

    def __init__(self):
        self.bufs: dict[str, torch.Tensor] = {}
        self.length = 0

    def append(self, parts: dict[str, torch.Tensor]) -> None:
        t = next(iter(parts.values())).shape[2]
        need = self.length + t
        for name, x in parts.items():
            self._room(name, x, need)[:, :, self.length : need] = x
        self.length = need

    def next_rows(self, t: int) -> dict[str, torch.Tensor]:
        """Views [B, kv_heads, t, ...] of every buffer's rows [length, length + t), grown first where full (as
        ``append``); the caller writes them, then adds t to ``length``."""
        need = self.length + t
        return {name: self._room(name, buf, need)[:, :, self.length : need] for name, buf in list(self.bufs.items())}

    def _room(self, name: str, like: torch.Tensor, need: int) -> torch.Tensor:
        """Buffer ``name`` with room for ``need`` rows: when absent or full, a new one of ``like``'s dtype and
        [B, kv_heads, :, ...] with spare capacity (``MIN_GROWTH`` or an eighth, rounded up to ``ROW_ALIGN``
        rows), the rows so far copied over. The spare rows are zeros: K/V rows the decode attention may read
        (``capacity``; FP4 zeros decode to 0)."""
        buf = self.bufs.get(name)
        if buf is None or buf.shape[2] < need:
            cap = -(-(need + max(MIN_GROWTH, need // 8)) // ROW_ALIGN) * ROW_ALIGN
            new = like.new_zeros((like.shape[0], like.shape[1], cap, *like.shape[3:]))
            if buf is not None:
                new[:, :, : self.length] = buf[:, :, : self.length]
            self.bufs[name] = buf = new
        return buf

    def view(self, name: str) -> torch.Tensor:
        return self.bufs[name][:, :, : self.length]

    @property
    def capacity(self) -> int:
        """Rows every buffer holds (written ones and zeros after them)."""
        return min((b.shape[2] for b in self.bufs.values()), default=0)

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (int64 [B']; repeats fork a row)."""
        self.bufs = {n: b.index_select(0, index) for n, b in self.bufs.items()}

    def nbytes(self) -> int:
        return sum(self.view(n).numel() * b.element_size() for n, b in self.bufs.items())


def _on_triton(kernel: str, x: torch.Tensor, quantizer: Quantizer) -> bool:
    """Whether ``kernels.quantize`` of x takes the Triton path (``kernels.select_kernel``)."""
    unsupported = "stochastic rounding has no Triton path" if quantizer.rounding != "rne" else None
    return select_kernel(kernel, x.device, unsupported=unsupported) is Kernel.TRITON


class _FP4Rows:
    """Packed FP4 rows of one of K or V, [B, kv_heads, T, ...], growing along T."""

    def __init__(self, kernel: str = "reference"):
        self.kernel = kernel
        self.store = _Growing()
        self.meta: tuple[str, torch.dtype, int] | None = None  # fmt, scale dtype, head_dim

    @property
    def length(self) -> int:
        return self.store.length

    def quantize_append(self, x: torch.Tensor, quantizer: Quantizer) -> None:
        """Quantize x [B, kv_heads, t, head_dim] and append it.

        A one-token update on the Triton path is one kernel that writes codes, scales and amax straight into the
        buffers (``_write_token``); else quantize, then copy (``append``)."""
        if x.shape[2] == 1 and self._writes_in_place(x, quantizer):
            self._write_token(x, quantizer)
        else:
            self.append(kernel_quantize(x, quantizer, kernel=self.kernel, check_finite=False))

    def _writes_in_place(self, x: torch.Tensor, quantizer: Quantizer) -> bool:
        """Whether the buffers exist, are contiguous (one row step) and fit x's rows and format, and the quantize
        runs on Triton."""
        bufs = self.store.bufs
        return (self.length > 0 and self.meta == (quantizer.fmt, quantizer.format.scale_dtype, x.shape[-1])
                and tuple(bufs["codes"].shape[:2]) == tuple(x.shape[:2]) and bufs["codes"].device == x.device
                and ("amax" in bufs) == (quantizer.fmt == "nvfp4") and all(b.is_contiguous() for b in bufs.values())
                and _on_triton(self.kernel, x, quantizer))

    def _write_token(self, x: torch.Tensor, quantizer: Quantizer) -> None:
        """``fused.quantize(out=...)`` of one token into rows ``length`` of the buffers [B, kv_heads, capacity, ...]
        (row m = b * kv_heads + h of x at m * capacity rows: one row step), grown first when full."""
        from ..kernels import fused  # imports Triton

        rows = self.store.next_rows(1)
        fmt, scale_dtype, _ = self.meta
        out = FP4Tensor(codes=rows["codes"], block_scales=rows["scales"].view(scale_dtype),
                        global_amax=rows.get("amax"), shape=tuple(x.shape), fmt=fmt)
        fused.quantize(x, quantizer, check_finite=False, out=out)
        self.store.length += 1

    def append(self, q: FP4Tensor) -> None:
        parts = {"codes": q.codes, "scales": q.block_scales.view(torch.uint8)}
        if q.global_amax is not None:
            g = q.global_amax.float()
            parts["amax"] = g.reshape(1, 1, 1, 1).expand(*q.shape[:3], 1) if g.dim() == 0 else g
        self.meta = (q.fmt, q.block_scales.dtype, q.shape[-1])
        self.store.append(parts)

    def fp4(self) -> FP4Tensor:
        """The history as one FP4Tensor [B, kv_heads, T, head_dim] (views of the buffers; per-row amax)."""
        fmt, scale_dtype, hd = self.meta
        codes = self.store.view("codes")
        amax = self.store.view("amax") if "amax" in self.store.bufs else None
        return FP4Tensor(codes=codes, block_scales=self.store.view("scales").view(scale_dtype), global_amax=amax,
                         shape=(*codes.shape[:3], hd), fmt=fmt)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        # per-row scales: decoding the stored rows equals decoding each chunk
        return kernel_dequantize(self.fp4(), dtype, kernel=self.kernel)

    def nbytes(self) -> int:
        return self.store.nbytes()

    def select(self, index: torch.Tensor) -> None:
        self.store.select(index)


class _PlainRows:
    """Unquantized rows [B, kv_heads, T, head_dim] in the model dtype."""

    def __init__(self):
        self.store = _Growing()

    def append(self, x: torch.Tensor) -> torch.Tensor:
        self.store.append({"x": x})
        return self.store.view("x")

    def nbytes(self) -> int:
        return self.store.nbytes()

    def select(self, index: torch.Tensor) -> None:
        self.store.select(index)


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
    when a recorder is given. ``kernel``: "auto" | "reference" | "triton" (``kernels.select_kernel``)."""

    def __init__(self, layer_idx: int, quantizer: KVQuantizer, *, quantize_k: bool = True,
                 quantize_v: bool = True, recorder: GuidanceRecorder | None = None, kernel: str = "auto",
                 fused_decode: bool = False, fast_attention: bool = False, interval_masks: bool = False):
        super().__init__()
        self.fast_attention = fast_attention  # the fused decode reads K/V as exact FP4 values (exact=False)
        self.interval_masks = interval_masks  # the fused decode reads each row's attended interval (FP4KVCache)
        self.mask_holes = FiniteCounter("interval mask rows with a hole")  # (the cache's layers share one)
        self.layer_idx = layer_idx
        reference_only = not isinstance(quantizer, Quantizer)  # SGLang's KV format: no Triton, no fused decode
        self.fused_decode = fused_decode and quantize_k and quantize_v and not reference_only
        self.quantizer = quantizer
        self.quantize_k, self.quantize_v = quantize_k, quantize_v
        self.recorder = recorder
        self.kernel = "reference" if reference_only else kernel
        self._rows: dict[str, _FP4Rows | _PlainRows] = {}
        self._length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = torch.tensor([], dtype=key_states.dtype, device=self.device)  # the history lives in _rows
        self.values = torch.tensor([], dtype=value_states.dtype, device=self.device)
        self._rows = {"kv_k": _FP4Rows(self.kernel) if self.quantize_k else _PlainRows(),
                      "kv_v": _FP4Rows(self.kernel) if self.quantize_v else _PlainRows()}
        self._length = 0
        self.is_initialized = True

    def _store(self, site: str, x: torch.Tensor, read: bool = True) -> torch.Tensor | None:
        """x [B, kv_heads, t, head_dim] -> whole history [B, kv_heads, T, head_dim] (dequantized; None unless
        ``read``)."""
        rows = self._rows[site]
        if isinstance(rows, _PlainRows):
            return rows.append(x)
        rec = self.recorder
        if not isinstance(self.quantizer, Quantizer):  # SGLang's KV format: the reference, recorded per step
            q = self.quantizer.quantize(x)
            rows.append(q)
            if rec is not None:
                rec.add_heads_major(self.layer_idx, site, q)
        else:  # recorded from the stored rows when the rollout ends (GuidanceRecorder.add_kv_history)
            rows.quantize_append(x, self.quantizer)
            if rec is not None:
                rec.add_kv_history(self.layer_idx, site, rows.fp4)
        return rows.dequantize(x.dtype) if read else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        defer = self.fused_decode and key_states.shape[-2] == 1
        keys = self._store("kv_k", key_states, read=not defer)
        values = self._store("kv_v", value_states, read=not defer)
        self._length += key_states.shape[-2]
        if defer:  # the attention reads the packed history (see the module docstring)
            setattr(key_states, DEFERRED_ATTR, self)
            return key_states, value_states
        return keys, values

    def packed_history(self) -> tuple[FP4Tensor, FP4Tensor]:
        """The packed K and V history [B, kv_heads, T, head_dim] of a layer whose K and V are both FP4."""
        return self._rows["kv_k"].fp4(), self._rows["kv_v"].fp4()

    def readable_rows(self) -> int:
        """Rows of ``packed_history``'s buffers that may be read (>= T: the history, then zeros), for the decode
        attention's ``readable_rows``."""
        return min(rows.store.capacity for rows in self._rows.values())

    def fp4_history(self, site: str) -> FP4Tensor | None:
        """The stored FP4 history of ``site`` ("kv_k" | "kv_v") [B, kv_heads, T, head_dim], None if unquantized."""
        rows = self._rows.get(site)
        return rows.fp4() if isinstance(rows, _FP4Rows) and rows.length else None

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def reset(self) -> None:
        self._rows, self._length = {}, 0
        super().reset()

    def nbytes(self) -> int:
        """Bytes held: FP4 payload of the quantized side(s) plus the unquantized tensors (used rows only)."""
        return sum(rows.nbytes() for rows in self._rows.values())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (or fork, with repeated indices) batch rows: the prefix reuse of ``generate``."""
        if not self.is_initialized:
            return
        index = torch.as_tensor(indices, dtype=torch.long, device=self.device)
        for rows in self._rows.values():
            rows.select(index)

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("FP4KVLayer supports prefill + decode and batch_select_indices only "
                                  "(no crop or beam reorder)")

    crop = batch_repeat_interleave = reorder_cache = _unsupported


class FP4KVCache(Cache):
    """A ``transformers`` Cache of ``FP4KVLayer`` (pass as ``cache=`` to the model)."""

    def __init__(self, num_layers: int, quantizer: KVQuantizer, *, quantize_k: bool = True,
                 quantize_v: bool = True, recorder: GuidanceRecorder | None = None,
                 bf16_layers: frozenset[int] = frozenset(), kernel: str = "auto", fused_decode: bool = False,
                 fast_attention: bool = False, interval_masks: bool = False):
        """``bf16_layers``: layers whose K and V stay in the model dtype (``TraceConfig.exclude_modules``).
        With ``quantize_k=quantize_v=False`` this is a plain preallocated cache in the model dtype.
        ``fused_decode``: see the module docstring; ``fast_attention``: its kernel's ``exact=False`` path.
        ``interval_masks``: the decode steps' attention masks attend one interval of positions per row, without
        holes (left padding before it, a finished row's tail after it: ``HFRolloutBackend.generate``'s masks).
        The fused decode then gives the kernel each row's (first, end) instead of the mask: no mask loads, and
        the rows outside are not read. A mask with a hole is counted (``mask_holes``), not silently attended."""
        layers = [FP4KVLayer(i, quantizer, quantize_k=quantize_k and i not in bf16_layers,
                             quantize_v=quantize_v and i not in bf16_layers, recorder=recorder, kernel=kernel,
                             fused_decode=fused_decode, fast_attention=fast_attention, interval_masks=interval_masks)
                  for i in range(num_layers)]
        super().__init__(layers=layers)
        self.mask_holes = FiniteCounter("interval mask rows with a hole")
        for layer in layers:
            layer.mask_holes = self.mask_holes

    def check_interval_masks(self) -> None:
        """Raise ``ValueError`` if a decode step's mask had a row with a hole since the last check (one host sync;
        none when no interval was taken). Resets the count."""
        if not self.mask_holes.used:
            return
        (_, n), = read_and_reset([self.mask_holes])
        if n:
            raise ValueError(f"{n} decode-step mask row(s) attended more than one run of positions, but this "
                             "FP4KVCache has interval_masks=True (one interval per row: left padding, finished "
                             "tails); those rows attended their whole interval. Use interval_masks=False for "
                             "such masks")

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``, run eagerly where the calling layer is compiled
        (``HFRolloutBackend(compile="layers")``): the FP4 kernels, the recorder and per-layer state stay untraced."""
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
