"""Row stores of the FP4 KV cache: buffers [B, kv_heads, capacity, ...] that grow along the token axis (or are
allocated once at a static capacity), packed FP4 rows with their scales and per-row amax, and plain rows in the
model dtype (``kv_cache.FP4KVLayer`` holds one per K and V).

On the Triton path a one-token append is one quantize launch that writes the token's codes, scales and amax straight
into the buffers (``fused.quantize(out=)``); a prefill quantizes, then copies, and its attention reads the dequantized
rows that the quantize pass wrote beside the codes. Spare rows are zeros, which the decode attention may read (FP4
zeros decode to 0).
"""

from __future__ import annotations

import torch

from ..formats import FP4Tensor, Quantizer
from ..kernels import Kernel, select_kernel
from ..kernels import dequantize as kernel_dequantize
from ..kernels import quantize as kernel_quantize
from ..kernels.checks import FiniteCounter
from ..kernels.kv_attention import ROW_ALIGN  # capacities in multiples of it: the attention's aligned loads
from .base import is_int
from .finite import naming

MIN_GROWTH = 256
"""Extra token slots allocated when a buffer grows (at least; else an eighth of the length)."""


class GrowingRows:
    """Named tensors [B, kv_heads, T, ...] stored in buffers with spare capacity along T."""

    def __init__(self, reserve: int = 0):
        self.bufs: dict[str, torch.Tensor] = {}
        self.length = 0
        self.reserve = reserve  # rows every new buffer holds at least (a static cache's capacity)

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
            cap = need + max(MIN_GROWTH, need // 8) if need > self.reserve else self.reserve  # a reserve: exact
            cap = -(-cap // ROW_ALIGN) * ROW_ALIGN
            new = like.new_zeros((like.shape[0], like.shape[1], cap, *like.shape[3:]))
            if buf is not None:
                new[:, :, : self.length] = buf[:, :, : self.length]
            self.bufs[name] = buf = new
        return buf

    def view(self, name: str) -> torch.Tensor:
        return self.bufs[name][:, :, : self.length]

    def write_at(self, parts: dict[str, torch.Tensor], position: torch.Tensor) -> None:
        """Write one row [B, kv_heads, 1, ...] per buffer at row ``position`` (int64 [1] on the device), into the
        buffers as they are (a static cache's: never grown here); ``length`` is left to the caller."""
        for name, x in parts.items():
            self.bufs[name].index_copy_(2, position, x)

    @property
    def capacity(self) -> int:
        """Rows every buffer holds (written ones and zeros after them)."""
        return min((b.shape[2] for b in self.bufs.values()), default=0)

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (int64 [B']; repeats fork a row)."""
        self.bufs = {n: b.index_select(0, index) for n, b in self.bufs.items()}

    def nbytes(self) -> int:
        return sum(self.view(n).numel() * b.element_size() for n, b in self.bufs.items())


class StaticPosition:
    """The decode row of a static cache (``FP4KVCache(static_rows=)``), shared by its layers: a device int64 [1]
    the caller sets before each decode step, so the step's kernels read device values only (a CUDA graph replays
    them); ``rows`` is the capacity every buffer is allocated with at the prefill."""

    def __init__(self, rows: int):
        if not is_int(rows) or rows < 1 or rows % ROW_ALIGN:  # (64.0 was taken; "64" a bare TypeError)
            raise ValueError(f"static_rows={rows!r} must be a positive multiple of {ROW_ALIGN} (the buffers' rows, "
                             "which the decode attention reads in aligned tiles): prompt plus new tokens, rounded up")
        self.rows = rows
        self._pos: torch.Tensor | None = None

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The row tensor, made on ``device`` at the first call (one tensor for good: a captured graph reads it)."""
        device = torch.device(device)
        if self._pos is None:
            self._pos = torch.zeros(1, dtype=torch.long, device=device)
        elif self._pos.device.type != device.type or device.index not in (None, self._pos.device.index):
            raise ValueError(f"the static cache's decode row lives on {self._pos.device}, not {device}")
        return self._pos


def _on_triton(kernel: str, x: torch.Tensor, quantizer: Quantizer) -> bool:
    """Whether ``kernels.quantize`` of x takes the Triton path (``kernels.select_kernel``)."""
    unsupported = "stochastic rounding has no Triton path" if quantizer.rounding != "rne" else None
    return select_kernel(kernel, x.device, unsupported=unsupported) is Kernel.TRITON


class FP4Rows:
    """Packed FP4 rows of one of K or V, [B, kv_heads, T, ...], growing along T."""

    def __init__(self, kernel: str = "reference", reserve: int = 0):
        self.kernel = kernel
        self.store = GrowingRows(reserve)
        self.meta: tuple[str, torch.dtype, int] | None = None  # fmt, scale dtype, head_dim
        self._writer = None  # (fused.RowWriter, the codes buffer it writes) of the static decode writes

    @property
    def length(self) -> int:
        return self.store.length

    def quantize_append(self, x: torch.Tensor, quantizer: Quantizer, read: bool = False,
                        check: FiniteCounter | None = None) -> torch.Tensor | None:
        """Quantize x [B, kv_heads, t, head_dim] and append it; ``read``: return the whole history dequantized
        (in x.dtype; else None). ``check``: the site's NaN/Inf counter (``rollout.finite``: the Triton quantize
        counts into it, the reference's error names it), or None (unchecked on the Triton path).

        A one-token update on the Triton path is one kernel that writes codes, scales and amax straight into the
        buffers (``_write_token``); else quantize, then copy (``append``). A prefill (nothing stored yet) that is
        read takes its dequantized rows from the quantize's own pass (``fused.quantize(deq_dtype=)``, the same bits
        as dequantizing the stored rows) instead of a second kernel over them."""
        checked = False if check is None else check
        if x.shape[2] == 1 and self._writes_in_place(x, quantizer):
            self._write_token(x, quantizer, checked)
        elif read and self.length == 0 and _on_triton(self.kernel, x, quantizer):
            from ..kernels import fused  # imports Triton

            q, _, out = fused.quantize(x, quantizer, deq_dtype=x.dtype, check_finite=checked)
            self.append(q)
            return out["deq"].view(x.shape)
        else:
            with naming(check):
                self.append(kernel_quantize(x, quantizer, kernel=self.kernel, check_finite=checked))
        return self.dequantize(x.dtype) if read else None

    def _writes_in_place(self, x: torch.Tensor, quantizer: Quantizer) -> bool:
        """Whether the buffers exist, are contiguous (one row step) and fit x's rows and format, and the quantize
        runs on Triton."""
        bufs = self.store.bufs
        return (self.length > 0 and self.meta == (quantizer.fmt, quantizer.format.scale_dtype, x.shape[-1])
                and tuple(bufs["codes"].shape[:2]) == tuple(x.shape[:2]) and bufs["codes"].device == x.device
                and ("amax" in bufs) == (quantizer.fmt == "nvfp4") and all(b.is_contiguous() for b in bufs.values())
                and _on_triton(self.kernel, x, quantizer))

    def _write_token(self, x: torch.Tensor, quantizer: Quantizer, checked: bool | FiniteCounter = False) -> None:
        """``fused.quantize(out=...)`` of one token into rows ``length`` of the buffers [B, kv_heads, capacity, ...]
        (row m = b * kv_heads + h of x at m * capacity rows: one row step), grown first when full."""
        from ..kernels import fused  # imports Triton

        fused.quantize(x, quantizer, check_finite=checked, out=self._token_out(self.store.next_rows(1), x))
        self.store.length += 1

    def _token_out(self, rows: dict[str, torch.Tensor], x: torch.Tensor) -> FP4Tensor:
        """One token's rows [B, kv_heads, 1, ...] of the buffers as the FP4Tensor ``fused.quantize`` writes."""
        fmt, scale_dtype, _ = self.meta
        return FP4Tensor(codes=rows["codes"], block_scales=rows["scales"].view(scale_dtype),
                         global_amax=rows.get("amax"), shape=tuple(x.shape), fmt=fmt)

    @staticmethod
    def _parts(q: FP4Tensor) -> dict[str, torch.Tensor]:
        """q's codes, scales (bytes) and per-row amax as the buffers store them."""
        parts = {"codes": q.codes, "scales": q.block_scales.view(torch.uint8)}
        if q.global_amax is not None:
            g = q.global_amax.float()
            parts["amax"] = g.reshape(1, 1, 1, 1).expand(*q.shape[:3], 1) if g.dim() == 0 else g
        return parts

    def append(self, q: FP4Tensor) -> None:
        self.meta = (q.fmt, q.block_scales.dtype, q.shape[-1])
        self.store.append(self._parts(q))

    def quantize_write_at(self, x: torch.Tensor, quantizer: Quantizer, position: torch.Tensor,
                          check: FiniteCounter | None = None) -> None:
        """Quantize one token x [B, kv_heads, 1, head_dim] into row ``position`` (device int64 [1]) of the
        buffers, which must exist and fit it (a static cache after its prefill). On the Triton path (NVFP4 per
        row or MXFP4) one kernel writes codes, scales and amax at the row it reads from ``position``
        (``fused.quantize(out_row=)``, kept as a ``fused.RowWriter`` while the buffers, quantizer, row tensor and x's
        layout stay the same: a decode step's write then costs one launch of host time); else quantize, then
        ``index_copy_``. ``check``: as ``quantize_append``'s."""
        kept = self._writer
        if (kept is not None and kept[1] is self.store.bufs.get("codes")
                and kept[0].fits(x, quantizer, position, check)):
            kept[0](x)
            return
        checked = False if check is None else check
        if self._writes_in_place(x, quantizer):
            from ..kernels import fused  # imports Triton

            if fused.writes_at(x, quantizer):
                row0 = {name: buf[:, :, :1] for name, buf in self.store.bufs.items()}
                out = self._token_out(row0, x)
                if not fused.RowWriter.takes(x, quantizer):  # (rows that need a copy first)
                    fused.quantize(x, quantizer, check_finite=checked, out=out, out_row=position)
                    return
                w = fused.RowWriter(x, quantizer, out, position, check_finite=check)
                self._writer = (w, self.store.bufs["codes"])  # (valid while the store keeps these buffers)
                w(x)
                return
        with naming(check):
            q = kernel_quantize(x, quantizer, kernel=self.kernel, check_finite=checked)
        if self.meta != (q.fmt, q.block_scales.dtype, q.shape[-1]):
            raise ValueError(f"token rows {q.fmt} / head_dim {q.shape[-1]} do not fit the stored {self.meta}")
        self.store.write_at(self._parts(q), position)

    def fp4(self, capacity: bool = False) -> FP4Tensor:
        """The history as one FP4Tensor [B, kv_heads, T, head_dim] (views of the buffers; per-row amax), or with
        ``capacity`` every row the buffers hold (T = ``store.capacity``: the history, then zeros)."""
        fmt, scale_dtype, hd = self.meta
        view = (lambda n: self.store.bufs[n]) if capacity else self.store.view
        codes = view("codes")
        amax = view("amax") if "amax" in self.store.bufs else None
        return FP4Tensor(codes=codes, block_scales=view("scales").view(scale_dtype), global_amax=amax,
                         shape=(*codes.shape[:3], hd), fmt=fmt)

    def dequantize(self, dtype: torch.dtype, capacity: bool = False) -> torch.Tensor:
        # per-row scales: decoding the stored rows equals decoding each chunk
        return kernel_dequantize(self.fp4(capacity), dtype, kernel=self.kernel)

    def nbytes(self) -> int:
        return self.store.nbytes()

    def select(self, index: torch.Tensor) -> None:
        self._writer = None
        self.store.select(index)


class PlainRows:
    """Unquantized rows [B, kv_heads, T, head_dim] in the model dtype."""

    def __init__(self, reserve: int = 0):
        self.store = GrowingRows(reserve)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        self.store.append({"x": x})
        return self.store.view("x")

    def nbytes(self) -> int:
        return self.store.nbytes()

    def select(self, index: torch.Tensor) -> None:
        self.store.select(index)
