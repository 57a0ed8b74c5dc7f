"""An FP4 KV cache for transformers: K/V stored as packed FP4, dequantized on read.

Rows are one token of one KV head (blocks along head_dim), quantized with the activation
quantizer (NVFP4: per-row global amax) after RoPE, i.e. exactly the K/V that attention reads.
Each ``update`` returns the whole dequantized history, the new tokens included, so a decode
step sees the same K/V as a full-sequence forward with fake-quantized K/V.

Storage (``rollout.kv_rows``): preallocated buffers [B, kv_heads, capacity, ...] that grow geometrically (a
decode step writes one token in place; no per-step copy of the history), or are allocated once for
``static_rows`` (``rollout.static_decode``). A per-tensor global amax is stored per row (the same value in
every row of a chunk: dequantizes to the same bits). A recorder records the ``kv_k`` / ``kv_v`` sites of FP4
rows from this stored history when the rollout ends (``GuidanceRecorder.add_kv_history``), SGLang's format per
step. ``kernel`` (``TraceConfig.kernel``): on CUDA, "auto" quantizes and dequantizes with the Triton twins of
``formats`` (same bits as the reference).

``fused_decode=True``: a one-token update of a layer whose K and V are both FP4 (or, in a static cache, both
unquantized) stores the token but skips dequantizing the history: it returns the new token's K/V
[B, kv_heads, 1, head_dim] with the layer attached as ``DEFERRED_ATTR``, and the attention that follows must
read the history from it (``rollout.attention``: the fused FP4-KV decode attention, or the dense decode
attention over the static buffers; ``HFRolloutBackend`` selects it).

``finite`` (``rollout.finite.RolloutFiniteChecks``): the quantize calls count NaN/Inf K/V into its ``layer <i> kv_k``
/ ``kv_v`` counters (Triton path, no host sync; read by ``HFRolloutBackend.generate``) or raise naming them
(reference path). None: the Triton path does not check.

``TraceConfig.kv_format="sglang_kvfp4"`` (``formats.sglang_kvfp4.SGLangKVQuantizer``): rows are stored and recorded in
SGLang's FP4 KV-cache format (``formats.sglang_kvfp4``, the reference path: no Triton, no fused decode; reads
dequantize the history for SDPA), so the records guide a trainer with the same ``kv_format``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..formats import FP4Tensor, Quantizer
from ..formats.sglang_kvfp4 import SGLangKVQuantizer
from ..kernels.checks import FiniteCounter, read_and_reset
from ..kernels.dispatch import parse_kernel
from .base import check_bools, check_count
from .finite import RolloutFiniteChecks, naming
from .kv_rows import FP4Rows, PlainRows, StaticPosition
from .recorder import GuidanceRecorder

KVQuantizer = Quantizer | SGLangKVQuantizer
"""``TraceConfig.kv_quantizer()``: the activation quantizer, or SGLang's KV format (``kv_format``)."""

DEFERRED_ATTR = "_trace_fp4_kv_layer"
"""Attribute of the key tensor a deferred decode update returns: the ``FP4KVLayer`` holding the history."""


class FP4KVLayer(DynamicLayer):
    """One attention layer's cache. ``quantize_k``/``quantize_v`` choose which of K, V is FP4
    (the other is kept in the model dtype). Records the rollout's rows for ``kv_k``/``kv_v``
    when a recorder is given. ``kernel``: "auto" | "reference" | "triton" (``kernels.select_kernel``)."""

    def __init__(self, layer_idx: int, quantizer: KVQuantizer, *, quantize_k: bool = True,
                 quantize_v: bool = True, recorder: GuidanceRecorder | None = None, kernel: str = "auto",
                 fused_decode: bool = False, fast_attention: bool = False, interval_masks: bool = False,
                 static: StaticPosition | None = None, finite: RolloutFiniteChecks | None = None):
        super().__init__()
        self.finite = finite  # NaN/Inf counters of the quantize calls (see the module docstring)
        self.static = static  # decode steps write at static.tensor(): see FP4KVCache(static_rows=)
        self.fast_attention = fast_attention  # the fused decode reads K/V as exact FP4 values (exact=False)
        self.interval_masks = interval_masks  # the fused decode reads each row's attended interval (FP4KVCache)
        self.mask_holes = FiniteCounter("interval mask rows with a hole")  # (the cache's layers share one)
        self.layer_idx = layer_idx
        reference_only = not isinstance(quantizer, Quantizer)  # SGLang's KV format: no Triton, no fused decode
        if reference_only and static is not None and (quantize_k or quantize_v):
            raise ValueError("static_rows needs the activation quantizer's KV format, not kv_format='sglang_kvfp4'")
        plain = not quantize_k and not quantize_v and static is not None  # dense decode attention
        self.fused_decode = fused_decode and not reference_only and (quantize_k and quantize_v or plain)
        self.quantizer = quantizer
        self.quantize_k, self.quantize_v = quantize_k, quantize_v
        self.recorder = recorder
        self.kernel = "reference" if reference_only else kernel
        self._rows: dict[str, FP4Rows | PlainRows] = {}
        self._length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = torch.tensor([], dtype=key_states.dtype, device=self.device)  # the history lives in _rows
        self.values = torch.tensor([], dtype=value_states.dtype, device=self.device)
        n = 0 if self.static is None else self.static.rows
        if key_states.shape[-2] > n > 0:
            raise ValueError(f"a prefill of {key_states.shape[-2]} tokens does not fit static_rows={n}")
        self._rows = {"kv_k": FP4Rows(self.kernel, n) if self.quantize_k else PlainRows(n),
                      "kv_v": FP4Rows(self.kernel, n) if self.quantize_v else PlainRows(n)}
        self._length = 0
        self.is_initialized = True

    def _store(self, site: str, x: torch.Tensor, read: bool = True) -> torch.Tensor | None:
        """x [B, kv_heads, t, head_dim] -> whole history [B, kv_heads, T, head_dim] (dequantized; None unless
        ``read``)."""
        rows = self._rows[site]
        if isinstance(rows, PlainRows):
            return rows.append(x)
        rec = self.recorder
        check = self._counter(site)
        if not isinstance(self.quantizer, Quantizer):  # SGLang's KV format: the reference, recorded per step
            with naming(check):
                q = self.quantizer.quantize(x)
            rows.append(q)
            if rec is not None:
                rec.add_heads_major(self.layer_idx, site, q)
            return rows.dequantize(x.dtype) if read else None
        history = rows.quantize_append(x, self.quantizer, read, check=check)
        if rec is not None:  # recorded from the stored rows when the rollout ends
            rec.add_kv_history(self.layer_idx, site, rows.fp4)
        return history

    def _store_at(self, site: str, x: torch.Tensor, position: torch.Tensor, read: bool) -> torch.Tensor | None:
        """A static decode step: x [B, kv_heads, 1, head_dim] into row ``position`` -> every row of the buffers
        [B, kv_heads, static rows, head_dim] (dequantized; None unless ``read``); no host state changes."""
        rows = self._rows[site]
        if isinstance(rows, PlainRows):
            rows.store.write_at({"x": x}, position)
            return rows.store.bufs["x"]
        rows.quantize_write_at(x, self.quantizer, position, check=self._counter(site))
        if self.recorder is not None:
            self.recorder.add_kv_history(self.layer_idx, site, rows.fp4)
        return rows.dequantize(x.dtype, capacity=True) if read else None

    def _counter(self, site: str):
        return None if self.finite is None else self.finite.counter(self.layer_idx, site)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # a decode step (one new row after a prefill); a prefill of one token per row is a prefill (it attends
        # its own row only: a static cache's deferred history would be all its rows, zeros included)
        defer = self.fused_decode and key_states.shape[-2] == 1 and self._length > 0
        if self.static is not None and key_states.shape[-2] == 1 and self._length:  # lengths: advance()
            position = self.static.tensor(key_states.device)
            keys = self._store_at("kv_k", key_states, position, read=not defer)
            values = self._store_at("kv_v", value_states, position, read=not defer)
        else:
            keys = self._store("kv_k", key_states, read=not defer)
            values = self._store("kv_v", value_states, read=not defer)
            self._length += key_states.shape[-2]
        if defer:  # the attention reads the packed history (see the module docstring)
            setattr(key_states, DEFERRED_ATTR, self)
            return key_states, value_states
        return keys, values

    def packed_history(self) -> tuple[FP4Tensor, FP4Tensor] | tuple[torch.Tensor, torch.Tensor]:
        """The K and V history [B, kv_heads, T, head_dim] of a deferred layer: packed FP4 where K and V both are,
        else (a static cache's unquantized layer) its buffers in the model dtype. A static cache: T = its rows,
        the history then zeros; the attention mask says which rows are attended."""
        capacity = self.static is not None
        k, v = self._rows["kv_k"], self._rows["kv_v"]
        if isinstance(k, PlainRows):
            return k.store.bufs["x"], v.store.bufs["x"]
        return k.fp4(capacity), v.fp4(capacity)

    def advance(self, t: int) -> None:
        """A static cache's host bookkeeping: ``t`` more rows hold tokens (the decode writes leave it alone)."""
        n = self._length + t
        if self.static is None or n > self.static.rows:
            raise ValueError(f"advance({t}) needs a static cache with room: length {self._length}, "
                             f"static rows {None if self.static is None else self.static.rows}")
        self._length = n
        for rows in self._rows.values():
            rows.store.length = n

    def readable_rows(self) -> int:
        """Rows of ``packed_history``'s buffers that may be read (>= T: the history, then zeros), for the decode
        attention's ``readable_rows``."""
        return min(rows.store.capacity for rows in self._rows.values())

    def fp4_history(self, site: str) -> FP4Tensor | None:
        """The stored FP4 history of ``site`` ("kv_k" | "kv_v") [B, kv_heads, T, head_dim], None if unquantized."""
        rows = self._rows.get(site)
        return rows.fp4() if isinstance(rows, FP4Rows) and rows.length else None

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
                 fast_attention: bool = False, interval_masks: bool = False, static_rows: int | None = None,
                 finite: RolloutFiniteChecks | None = None):
        """``bf16_layers``: layers whose K and V stay in the model dtype (``TraceConfig.exclude_modules``).
        With ``quantize_k=quantize_v=False`` this is a plain preallocated cache in the model dtype.
        ``fused_decode``: see the module docstring; ``fast_attention``: its kernel's ``exact=False`` path.
        ``interval_masks``: the decode steps' attention masks attend one interval of positions per row, without
        holes (left padding before it, a finished row's tail after it: ``HFRolloutBackend.generate``'s masks).
        The fused decode then gives the kernel each row's (first, end) instead of the mask: no mask loads, and
        the rows outside are not read. A mask with a hole is counted (``mask_holes``), not silently attended.
        ``static_rows``: every buffer holds that many rows from the prefill on (never grown), and a one-token
        update writes at row ``decode_position()`` (a device tensor the caller sets) and returns / attends all
        rows, the attention mask [B, 1, 1, static_rows] saying which; the lengths advance only by ``advance`` (so a
        captured decode step replays: ``rollout.static_decode``). ``finite``: the NaN/Inf counters of the K/V
        quantize calls (see the module docstring)."""
        # ("no" turned quantize_k on, kernel="tritonn" and num_layers=0 were taken; checked once for all layers)
        check_count("FP4KVCache.num_layers", num_layers)
        check_bools("FP4KVCache", quantize_k=quantize_k, quantize_v=quantize_v, fused_decode=fused_decode,
                    fast_attention=fast_attention, interval_masks=interval_masks)
        parse_kernel(kernel)
        if not set(bf16_layers) <= set(range(num_layers)):  # (such a layer was kept in FP4, silently)
            raise ValueError(f"FP4KVCache.bf16_layers={sorted(bf16_layers, key=repr)} must be layer ids in "
                             f"[0, {num_layers})")
        self.static = None if static_rows is None else StaticPosition(static_rows)
        layers = [FP4KVLayer(i, quantizer, quantize_k=quantize_k and i not in bf16_layers,
                             quantize_v=quantize_v and i not in bf16_layers, recorder=recorder, kernel=kernel,
                             fused_decode=fused_decode, fast_attention=fast_attention, interval_masks=interval_masks,
                             static=self.static, finite=finite)
                  for i in range(num_layers)]
        super().__init__(layers=layers)
        self.mask_holes = FiniteCounter("interval mask rows with a hole")
        for layer in layers:
            layer.mask_holes = self.mask_holes

    def decode_position(self) -> torch.Tensor:
        """A static cache's decode row: int64 [1] on the device, written by the next one-token update."""
        if self.static is None or not self.layers[0].is_initialized:
            raise ValueError("decode_position needs an FP4KVCache(static_rows=...) after its prefill")
        return self.static.tensor(self.layers[0].device)

    def advance(self, t: int = 1) -> None:
        """After ``t`` static decode steps: every layer's length grows by t (raises past ``static_rows``)."""
        for layer in self.layers:
            layer.advance(t)

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
