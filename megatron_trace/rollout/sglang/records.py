"""Guidance rows as bytes: what one forward records per token, and its assembly per request.

A site's rows for one token (``expert_fc1_in``: one row [hidden]; ``expert_fc2_in``: ``topk`` rows
[topk, ffn]) are encoded as one uint8 vector ``payload | block scales | global amax`` (payload =
packed codes in full mode, packed mantissa bits in compact mode; amax float32 per row, NVFP4 only: absent
for MXFP4 and ``sglang_kvfp4``). Bytes travel from the SGLang scheduler to the backend inside the request's
``meta_info`` (``customized_info``) and are decoded here into the ``SiteGuidance`` contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...formats import CompactGuidance, FP4Tensor, FullGuidance, e2m1, sglang_kvfp4
from ...formats.registry import get_format
from ...guidance.site import SiteGuidance, SiteKey

Record = FullGuidance | CompactGuidance


def site_format(fmt: str):
    """The format object of a record's ``fmt``: the registry's, or SGLang's FP4 KV format."""
    return sglang_kvfp4.FORMAT if fmt == sglang_kvfp4.NAME else get_format(fmt)


@dataclass(frozen=True)
class SiteSpec:
    """Layout of one (layer, site)'s rows for one token: ``row_shape`` e.g. (hidden,), (topk, ffn) or
    (kv_heads, head_dim) with ``fmt="sglang_kvfp4"`` for KV rows read from SGLang's FP4 KV pool."""

    layer: int
    site: str
    row_shape: tuple[int, ...]
    fmt: str = "nvfp4"
    compact: bool = True

    @property
    def key(self) -> SiteKey:
        return (self.layer, self.site)

    @property
    def wire_key(self) -> str:
        return f"{self.layer}:{self.site}"

    def _parts(self) -> tuple[int, int, int]:
        """(payload, scale, amax) bytes per token."""
        block = site_format(self.fmt).block_size
        lead = 1
        for d in self.row_shape[:-1]:
            lead *= d
        kp = -(-self.row_shape[-1] // block) * block
        payload = kp // 8 if self.compact else kp // 2
        amax = 4 if self.fmt == "nvfp4" else 0
        return lead * payload, lead * (kp // block), lead * amax

    @property
    def nbytes(self) -> int:
        return sum(self._parts())


def _bytes(t: torch.Tensor, tokens: int) -> torch.Tensor:
    """t [tokens, ...] -> uint8 [tokens, bytes per token] (the width explicit, not -1: 0 tokens have 0 elements)."""
    return t.contiguous().view(torch.uint8).reshape(tokens, math.prod(t.shape[1:]) * t.element_size())


def mantissa_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., Kp/2] -> packed mantissa bits [..., Kp/8] (device ops only: CUDA-graph capturable)."""
    return e2m1.pack_bits(e2m1.mantissa_bit(e2m1.unpack(codes)))


def encode_rows(q: FP4Tensor, spec: SiteSpec) -> torch.Tensor:
    """A quantized tensor [T, *row_shape] -> uint8 [T, spec.nbytes] (compact or full, per ``spec``).

    Device ops only, no host sync (called inside the forward, also under CUDA-graph capture)."""
    if tuple(q.shape[1:]) != spec.row_shape or q.fmt != spec.fmt:
        raise ValueError(f"{spec.key}: rows {q.fmt} {tuple(q.shape)} do not match the spec {spec.fmt} "
                         f"[T, {', '.join(map(str, spec.row_shape))}]")
    tokens = q.shape[0]
    payload = mantissa_bytes(q.codes) if spec.compact else q.codes
    parts = [_bytes(payload, tokens), _bytes(q.block_scales, tokens)]
    if spec.fmt == "nvfp4":
        g = q.global_amax.float()
        g = g.expand(*q.codes.shape[:-1], 1) if g.dim() == 0 else g  # per-tensor amax stored per row
        # a copy, not ``contiguous()``: the expansion of one row (a decode step of one request, e.g. the native
        # path's per-tensor amax) counts as contiguous with stride 0, which a uint8 view of float32 refuses
        parts.append(_bytes(g.clone(memory_format=torch.contiguous_format), tokens))
    return torch.cat(parts, dim=1)


def decode_rows(buf: torch.Tensor, spec: SiteSpec) -> Record:
    """uint8 [N, spec.nbytes] -> a record of shape [N, *row_shape]."""
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != spec.nbytes:
        raise ValueError(f"{spec.key}: expected uint8 [N, {spec.nbytes}], got {buf.dtype} {tuple(buf.shape)}")
    n = buf.shape[0]
    pay, sc, am = spec._parts()
    lead = spec.row_shape[:-1]
    fmt = site_format(spec.fmt)
    per_token = math.prod(lead)  # row_shape rows per token (explicit sizes, not -1: 0 rows have 0 elements)
    payload = buf[:, :pay].reshape(n, *lead, pay // per_token).contiguous()
    scales = buf[:, pay : pay + sc].reshape(n, *lead, sc // per_token).contiguous().view(fmt.scale_dtype)
    # a fresh copy: a column slice of 0 or 1 rows counts as contiguous and keeps buf's row stride and offset,
    # which a float32 view refuses
    amax = None
    if am:
        amax = buf[:, pay + sc :].clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(n, *lead, 1)
    common = dict(block_scales=scales, global_amax=amax, shape=(n, *spec.row_shape), fmt=spec.fmt)
    return CompactGuidance(mantissa_bits=payload, **common) if spec.compact else FullGuidance(codes=payload, **common)


def _zeros_record(spec: SiteSpec, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(b, s, spec.nbytes, dtype=torch.uint8), torch.zeros(b, s, dtype=torch.bool)


def assemble(per_request: list[list[dict]], specs: list[SiteSpec], seq_len: int,
             routing: dict[int, torch.Tensor] | None = None) -> dict[SiteKey, SiteGuidance]:
    """Per request, the step payloads ``{"start": pos, "n": rows, "sites": {wire_key: bytes}}`` ->
    batch-major ``SiteGuidance`` [B, seq_len, ...]. Positions never recorded (prefix-cache hits,
    the last sampled token) are invalid. ``routing[layer]`` int64 [B, S, topk] gives expert_fc2_in's
    expert ids (required for that site)."""
    b = len(per_request)
    out: dict[SiteKey, SiteGuidance] = {}
    for spec in specs:
        data, valid = _zeros_record(spec, b, seq_len)
        for i, steps in enumerate(per_request):
            for step in steps:
                raw = step["sites"].get(spec.wire_key)
                if raw is None:
                    continue
                start, n = int(step["start"]), int(step["n"])
                if n == 0 and not raw:  # (a read-out whose prefix left the radix cache; frombuffer refuses b"")
                    continue
                if n < 0 or len(raw) != n * spec.nbytes:
                    raise ValueError(f"request {i}: {spec.key}'s payload at position {start} has {len(raw)} bytes for "
                                     f"n={n} rows of {spec.nbytes} bytes (want {max(n, 0) * spec.nbytes})")
                rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(n, spec.nbytes)
                stop = min(start + n, seq_len)
                if stop > start:
                    data[i, start:stop] = rows[: stop - start]
                    valid[i, start:stop] = True
        rec = decode_rows(data.reshape(b * seq_len, -1), spec)
        rec = _reshape_record(rec, (b, seq_len, *spec.row_shape))
        if spec.site == "expert_fc2_in":
            if routing is None or spec.layer not in routing:
                raise ValueError(f"expert_fc2_in of layer {spec.layer} needs the routing (return_routed_experts)")
            ids = routing[spec.layer]
            out[spec.key] = SiteGuidance(rec, valid.unsqueeze(-1).expand_as(ids).clone(), ids)
        else:
            out[spec.key] = SiteGuidance(rec, valid)
    return out


def _reshape_record(rec: Record, shape: tuple[int, ...]) -> Record:
    import dataclasses

    lead = shape[:-1]
    f = lambda t: t.reshape(*lead, t.shape[-1])  # noqa: E731
    payload = "mantissa_bits" if isinstance(rec, CompactGuidance) else "codes"
    amax = None if rec.global_amax is None else f(rec.global_amax)
    return dataclasses.replace(rec, block_scales=f(rec.block_scales.view(torch.uint8)).view(rec.block_scales.dtype),
                               global_amax=amax, shape=shape, **{payload: f(getattr(rec, payload))})
