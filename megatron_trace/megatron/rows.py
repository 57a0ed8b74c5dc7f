"""Guidance rows in Megatron's layouts, and a byte codec that lets them travel through a dispatcher.

Megatron orders the tokens of a micro-batch sequence-major: token ``t = s * B + b`` of a
[S, B, H] hidden state. The guidance contract (``guidance/site.py``) is batch-major [B, S, ...].
``token_major`` converts (and cuts the local sequence shard under sequence parallelism).

``RowCodec`` packs one record row (codes or mantissa bits, block scales, per-row global amax)
plus a valid flag into a fixed number of bytes (uint8), so that guidance rows can be moved with
the same dispatch as the token rows they belong to, and unpacked bit-exactly on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import CompactGuidance, FullGuidance, get_format

Record = FullGuidance | CompactGuidance


@dataclass(frozen=True)
class RowGuidance:
    """Guidance for N rows of one site: ``record.shape`` [N, K] (per-row amax), ``valid`` bool [N]."""

    record: Record
    valid: torch.Tensor
    all_valid: bool = False  # known on the host (checked once per step): every row is valid

    @property
    def num_rows(self) -> int:
        return int(self.valid.shape[0])


def payload_of(record: Record) -> torch.Tensor:
    """Packed codes (full) or packed mantissa bits (compact)."""
    return record.mantissa_bits if isinstance(record, CompactGuidance) else record.codes


def map_record(record: Record, fn, shape: tuple[int, ...]) -> Record:
    """Apply ``fn`` to every row-indexed tensor of ``record`` (payload, scales, per-row amax)."""
    amax = record.global_amax
    if amax is not None:
        amax = fn(amax.expand(*record.block_scales.shape[:-1], 1) if amax.dim() == 0 else amax)
    field = "mantissa_bits" if isinstance(record, CompactGuidance) else "codes"
    kw = {field: fn(payload_of(record))}
    scales = fn(record.block_scales)
    return type(record)(block_scales=scales, global_amax=amax, shape=tuple(shape), fmt=record.fmt, **kw)


def token_major(t: torch.Tensor, seq: slice) -> torch.Tensor:
    """[B, S, ...] -> [S_local * B, ...] in Megatron's token order (rows ``s * B + b``)."""
    t = t[:, seq].transpose(0, 1)
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def batch_major(t: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of ``token_major`` for a full sequence: [S * B, ...] -> [B, S, ...]."""
    return t.reshape(-1, batch, *t.shape[1:]).transpose(0, 1).contiguous()


def take_record(record: Record, index: torch.Tensor) -> Record:
    """Rows ``index`` (int64 [M]) of a record of rows [N, K]."""
    return map_record(record, lambda x: x.index_select(0, index), (index.numel(), record.shape[-1]))


def take(rows: RowGuidance, index: torch.Tensor) -> RowGuidance:
    """Rows ``index`` (int64 [M]) of ``rows``."""
    return RowGuidance(take_record(rows.record, index), rows.valid.index_select(0, index))


@dataclass(frozen=True)
class RowCodec:
    """Fixed-width byte layout of one guidance row of ``k`` elements (see the module docstring)."""

    fmt: str
    k: int
    compact: bool

    @property
    def _block(self) -> int:
        return get_format(self.fmt).block_size

    @property
    def padded_k(self) -> int:
        return -(-self.k // self._block) * self._block

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Bytes of (payload, block scales, global amax)."""
        kp = self.padded_k
        return (kp // 8 if self.compact else kp // 2), kp // self._block, (4 if self.fmt == "nvfp4" else 0)

    @property
    def width(self) -> int:
        return sum(self.sizes) + 1  # + valid flag

    def encode(self, rows: RowGuidance) -> torch.Tensor:
        """RowGuidance [N, k] -> uint8 [N, width]."""
        rec, n = rows.record, rows.num_rows
        if rec.fmt != self.fmt or tuple(rec.shape) != (n, self.k) or rows_compact(rec) != self.compact:
            raise ValueError(f"record {type(rec).__name__}({rec.fmt}, shape={tuple(rec.shape)}) does not fit {self}")
        p, s, _ = self.sizes  # (not -1: a rank's share of 0 rows has 0 elements)
        parts = [payload_of(rec).reshape(n, p), rec.block_scales.reshape(n, s).view(torch.uint8)]
        if self.fmt == "nvfp4":
            amax = rec.global_amax.float()
            amax = amax.expand(n, 1) if amax.dim() == 0 else amax.reshape(n, 1)
            parts.append(encode_amax(amax))
        parts.append(rows.valid.reshape(n, 1).to(torch.uint8))
        return torch.cat([p.to(torch.uint8) for p in parts], dim=1)

    def decode(self, data: torch.Tensor) -> RowGuidance:
        """uint8 [N, width] -> RowGuidance [N, k] (bit-exact inverse of ``encode``)."""
        if data.dim() != 2 or data.shape[1] != self.width or data.dtype != torch.uint8:
            raise ValueError(f"expected uint8 [N, {self.width}] for {self}, got {data.dtype} {tuple(data.shape)}")
        n = data.shape[0]
        p, s, a = self.sizes
        payload = data[:, :p].contiguous()
        scale_dtype = get_format(self.fmt).scale_dtype
        scales = data[:, p : p + s].contiguous().view(scale_dtype)
        amax = decode_amax(data[:, p + s : p + s + a]) if a else None
        valid = data[:, -1] != 0
        kw = {"mantissa_bits": payload} if self.compact else {"codes": payload}
        cls = CompactGuidance if self.compact else FullGuidance
        rec = cls(block_scales=scales, global_amax=amax, shape=(n, self.k), fmt=self.fmt, **kw)
        return RowGuidance(rec, valid)

    def empty(self, n: int, device=None) -> torch.Tensor:
        """n all-invalid rows (zeros)."""
        return torch.zeros(n, self.width, dtype=torch.uint8, device=device)


def as_decoded(record: Record) -> Record:
    """``record`` in the dtypes ``RowCodec.decode`` returns (uint8 payload, the format's scales, float32
    amax): the same record as an encode/decode round trip, without one (no op where the dtypes are those)."""
    payload, scales, amax = payload_of(record), record.block_scales, record.global_amax
    scale_dtype = get_format(record.fmt).scale_dtype
    if payload.dtype == torch.uint8 and scales.dtype == scale_dtype and (amax is None or amax.dtype == torch.float32):
        return record
    kw = {"mantissa_bits" if rows_compact(record) else "codes": payload.to(torch.uint8)}
    return type(record)(block_scales=scales.view(torch.uint8).view(scale_dtype),
                        global_amax=None if amax is None else amax.float(), shape=record.shape, fmt=record.fmt, **kw)


def rows_compact(record: Record) -> bool:
    return isinstance(record, CompactGuidance)


def encode_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 [N, 1] -> uint8 [N, 4] (a copy: see ``decode_amax``; an expanded or empty amax too)."""
    return amax.float().reshape(-1, 1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def decode_amax(data: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 4] (e.g. columns of a wider buffer) -> float32 [N, 1]. Copied, not ``contiguous()``: a column slice
    of 0 or 1 rows counts as contiguous and keeps the buffer's row stride and offset, which a float32 view refuses."""
    return data.clone(memory_format=torch.contiguous_format).view(torch.float32)
