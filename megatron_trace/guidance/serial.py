"""Serialisation of ``SampleGuidance``: named tensors (safetensors shards) and flat bytes (sync, host cache).

Named tensors of one sample, ``"{layer}/{site}/{field}"``:
  payload     uint8    packed codes (full) or mantissa bits (compact)
  scales      uint8    block scales viewed as uint8 (E4M3 / E8M0 bit patterns)
  amax        float32  [] or [..., 1] (NVFP4 only)
  valid       bool
  expert_ids  int64    (FC2 only)
plus a JSON-able ``meta`` dict (ids, version, token hash, per-site kind/format/shape).

Flat form: several samples in one uint8 buffer; each tensor starts at a 16-byte aligned offset so
it can be viewed back without a copy. Round trips are bit-exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..formats import CompactGuidance, FullGuidance, get_format
from .records import SampleGuidance, SiteRecord, payload_of, tensor_bytes

ALIGN = 16
DTYPES = {"uint8": torch.uint8, "bool": torch.bool, "int64": torch.int64, "float32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class RecordFormatError(ValueError):
    """Serialised guidance that cannot be decoded (bad header, truncated buffer, checksum)."""


def _site_tensors(rec: SiteRecord) -> dict[str, torch.Tensor]:
    r = rec.record
    t = {"payload": payload_of(r), "scales": r.block_scales.view(torch.uint8), "valid": rec.valid}
    if r.global_amax is not None:
        t["amax"] = r.global_amax.to(torch.float32)
    if rec.expert_ids is not None:
        t["expert_ids"] = rec.expert_ids.to(torch.int64)
    return t


def sample_to_tensors(s: SampleGuidance) -> tuple[dict[str, torch.Tensor], dict]:
    """(named tensors, meta) of one sample; inverse of ``sample_from_tensors``."""
    tensors, sites = {}, []
    for (layer, site), rec in sorted(s.sites.items()):
        for field, t in _site_tensors(rec).items():
            tensors[f"{layer}/{site}/{field}"] = t
        kind = "compact" if rec.compact else "full"
        r = rec.record
        sites.append({"layer": layer, "site": site, "mode": kind, "fmt": r.fmt, "shape": list(r.shape)})
    meta = {
        "sample_id": s.sample_id, "version": s.version, "token_hash": s.token_hash,
        "num_tokens": s.num_tokens, "sites": sites,
    }
    return tensors, meta


def sample_from_tensors(meta: dict, tensors: dict[str, torch.Tensor]) -> SampleGuidance:
    """Rebuild a sample from ``sample_to_tensors`` output (tensors are used as given, no copy)."""
    try:
        sites = {}
        for m in meta["sites"]:
            layer, site = int(m["layer"]), str(m["site"])
            t = {f: tensors.get(f"{layer}/{site}/{f}") for f in ("payload", "scales", "amax", "valid", "expert_ids")}
            scales = t["scales"].view(get_format(m["fmt"]).scale_dtype)
            common = dict(block_scales=scales, global_amax=t["amax"], shape=tuple(m["shape"]), fmt=m["fmt"])
            if m["mode"] == "compact":
                rec = CompactGuidance(mantissa_bits=t["payload"], **common)
            else:
                rec = FullGuidance(codes=t["payload"], **common)
            sites[(layer, site)] = SiteRecord(rec, t["valid"], t["expert_ids"])
        return SampleGuidance(
            int(meta["sample_id"]), int(meta["version"]), str(meta["token_hash"]), int(meta["num_tokens"]), sites
        )
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise RecordFormatError(f"cannot decode guidance sample {meta.get('sample_id')!r}: {e}") from e


@dataclass
class FlatPlan:
    """Where each sample's tensors go in a flat buffer; ``metas[i]`` gains offset/nbytes/tensors."""

    metas: list[dict]
    parts: list[list[torch.Tensor]]  # per sample, uint8 1-D views in table order
    total: int

    @property
    def device(self) -> torch.device:
        """Where the samples' tensors live (CPU for an empty plan)."""
        return next((v.device for views in self.parts for v in views), torch.device("cpu"))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_flat(samples: Sequence[SampleGuidance]) -> FlatPlan:
    metas, parts, off = [], [], 0
    for s in samples:
        tensors, meta = sample_to_tensors(s)
        table, views, rel = [], [], 0
        for name, t in tensors.items():
            t = t.contiguous()
            table.append([name, _DTYPE_NAMES[t.dtype], list(t.shape), rel])
            views.append(t.reshape(-1).view(torch.uint8))
            rel = _align(rel + t.nbytes)
        meta.update(offset=off, nbytes=rel, tensors=table)
        metas.append(meta)
        parts.append(views)
        off += rel
    return FlatPlan(metas, parts, off)


def write_flat(plan: FlatPlan, out: torch.Tensor) -> torch.Tensor:
    """Copy the planned tensors into ``out`` (uint8, >= plan.total bytes, any device); returns the used slice."""
    if out.dtype != torch.uint8 or out.numel() < plan.total:
        raise ValueError(f"out must be uint8 with >= {plan.total} bytes, got {out.dtype} {out.numel()}")
    non_blocking = out.is_cuda  # device-side writes are stream-ordered; a host target must be complete
    for meta, views in zip(plan.metas, plan.parts):
        for (_, _, _, rel), v in zip(meta["tensors"], views):
            start = meta["offset"] + rel
            out[start : start + v.numel()].copy_(v, non_blocking=non_blocking)
    return out[: plan.total]


def flatten(samples: Sequence[SampleGuidance], device=None) -> tuple[list[dict], torch.Tensor]:
    """(metas, one uint8 buffer) holding ``samples``; padding bytes are zero."""
    plan = plan_flat(samples)
    buf = torch.zeros(plan.total, dtype=torch.uint8, device=device if device is not None else plan.device)
    return plan.metas, write_flat(plan, buf)


def checksum(buf: torch.Tensor) -> str:
    """blake2b-128 (hex) of a uint8 buffer's bytes."""
    return hashlib.blake2b(tensor_bytes(buf), digest_size=16).hexdigest()


def add_checksums(metas: list[dict], buf: torch.Tensor) -> None:
    """Store each sample's checksum (over its span of ``buf``) in its meta."""
    for m in metas:
        m["checksum"] = checksum(buf[m["offset"] : m["offset"] + m["nbytes"]])


def unflatten_one(meta: dict, span: torch.Tensor, *, verify: bool = False) -> SampleGuidance:
    """One sample from its own span of a flat buffer (views into ``span``)."""
    if span.numel() != meta.get("nbytes", -1):
        raise RecordFormatError(
            f"sample {meta.get('sample_id')}: {span.numel()} bytes, header says {meta.get('nbytes')}"
        )
    if verify and "checksum" in meta and checksum(span) != meta["checksum"]:
        raise RecordFormatError(f"sample {meta['sample_id']}: checksum mismatch (corrupt or partial transfer)")
    tensors = {}
    try:
        for name, dt, shape, rel in meta["tensors"]:
            dtype = DTYPES[dt]
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            if rel % ALIGN or rel + n > span.numel():
                raise RecordFormatError(f"tensor {name} at {rel}+{n} outside {span.numel()} bytes")
            tensors[name] = span[rel : rel + n].view(dtype).view(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise RecordFormatError(f"sample {meta.get('sample_id')}: bad tensor table: {e}") from e
    return sample_from_tensors(meta, tensors)


def unflatten(metas: Sequence[dict], buf: torch.Tensor, *, verify: bool = False) -> list[SampleGuidance]:
    """Inverse of ``flatten``: samples whose tensors are views into ``buf``."""
    out = []
    for m in metas:
        off, n = int(m["offset"]), int(m["nbytes"])
        if off < 0 or off + n > buf.numel():
            raise RecordFormatError(f"sample {m.get('sample_id')} spans {off}+{n}, buffer has {buf.numel()} bytes")
        out.append(unflatten_one(m, buf[off : off + n], verify=verify))
    return out
