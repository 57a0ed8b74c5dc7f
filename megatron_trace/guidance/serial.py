"""Serialisation of ``SampleGuidance``: named tensors (safetensors shards) and flat bytes (the host cache;
``GuidanceSync`` sends columns instead, ``guidance.wire``).

Named tensors of one sample, ``"{layer}/{site}/{field}"``:
  payload     uint8    packed codes (full) or mantissa bits (compact)
  scales      uint8    block scales viewed as uint8 (E4M3 / E8M0 bit patterns)
  amax        float32  [] or [..., 1] (NVFP4 only)
  valid       bool
  expert_ids  int64    (FC2 only)
plus a JSON-able ``meta`` dict (ids, version, token hash, per-site kind/format/shape).

Flat form: several samples in one uint8 buffer; each tensor starts at a 16-byte aligned offset so
it can be viewed back without a copy. Round trips are bit-exact. The buffer is written in one pass
(``memmove`` per tensor on the host, one ``torch.cat`` on a device) into a huge-page host buffer
(``host_buffer``), and checksummed with CRC-32 over each sample's contiguous span read in place.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..formats import CompactGuidance, FullGuidance, get_format
from .records import SampleGuidance, SiteRecord, is_integer, payload_of

ALIGN = 16
CHECKSUM = "crc32"
DTYPES = {"uint8": torch.uint8, "bool": torch.bool, "int64": torch.int64, "float32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FIELD_DTYPES = {"payload": torch.uint8, "scales": torch.uint8, "amax": torch.float32, "valid": torch.bool,
                "expert_ids": torch.int64}
"""The dtype of each field of a site (a table naming another would reinterpret the bytes)."""


_HUGE_PAGE = 1 << 21


def host_buffer(nbytes: int) -> torch.Tensor:
    """Uninitialised uint8 host tensor. From 2 MiB on it is an anonymous mmap advised for transparent huge
    pages: a fresh buffer then faults in 2 MiB at a time, not 4 KiB, and fills at memcpy speed. Freed with
    the last tensor that views it."""
    if nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # pragma: no cover - THP disabled: ordinary pages
        pass
    return torch.frombuffer(m, dtype=torch.uint8)


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
        sites, used = {}, set()
        for m in meta["sites"]:
            layer, site = _int(m["layer"], "layer"), str(m["site"])
            names = {f: f"{layer}/{site}/{f}" for f in FIELD_DTYPES}
            used.update(names.values())
            t = {f: tensors.get(name) for f, name in names.items()}
            _check_site(layer, site, m, t)
            scales = t["scales"].view(get_format(m["fmt"]).scale_dtype)
            common = dict(block_scales=scales, global_amax=t["amax"], shape=tuple(m["shape"]), fmt=m["fmt"])
            if m["mode"] == "compact":
                rec = CompactGuidance(mantissa_bits=t["payload"], **common)
            else:
                rec = FullGuidance(codes=t["payload"], **common)
            sites[(layer, site)] = SiteRecord(rec, t["valid"], t["expert_ids"])
        if tensors.keys() - used:  # e.g. a site's amax under another name: the record would lose it
            raise RecordFormatError(f"tensors {sorted(tensors.keys() - used)} belong to no site field of the meta")
        return SampleGuidance(
            _int(meta["sample_id"], "sample_id"), _int(meta["version"], "version"), str(meta["token_hash"]),
            _int(meta["num_tokens"], "num_tokens"), sites
        )
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise RecordFormatError(f"cannot decode guidance sample {meta.get('sample_id')!r}: {e}") from e


def _int(v, what: str) -> int:
    """``v`` as an int; a float (1.5, or 1.0) or a bool is a ``RecordFormatError``, not truncated."""
    if not is_integer(v):
        raise RecordFormatError(f"{what}={v!r} is not an int")
    return int(v)


def record_widths(where: str, meta: dict) -> dict[str, tuple[int, ...]]:
    """The trailing shapes of a record's payload and scales rows of ``meta``'s row shape, format and mode
    (``FP4Tensor`` layout); ``RecordFormatError`` naming ``where`` for an empty shape or unknown mode."""
    if meta["mode"] not in ("compact", "full"):
        raise RecordFormatError(f"{where}: mode {meta['mode']!r} is not 'compact' or 'full'")
    shape, fmt = tuple(int(n) for n in meta["shape"]), get_format(meta["fmt"])  # (raises on an unknown format)
    if not shape:
        raise RecordFormatError(f"{where}: empty row shape")
    blocks = -(-shape[-1] // fmt.block_size)
    per_byte = 8 if meta["mode"] == "compact" else 2
    return {"payload": (*shape[:-1], blocks * fmt.block_size // per_byte), "scales": (*shape[:-1], blocks)}


def check_widths(where: str, meta: dict, tails: dict[str, tuple[int, ...]]) -> None:
    """``tails`` (payload / scales row shapes) are ``record_widths``'; raises ``RecordFormatError`` naming them."""
    for name, want in record_widths(where, meta).items():
        if tails[name] != want:
            raise RecordFormatError(f"{where}: {name} rows {tails[name]} != {want} for {meta['mode']} {meta['fmt']} "
                                    f"rows of shape {tuple(meta['shape'])}")


def _check_site(layer: int, site: str, m: dict, t: dict[str, torch.Tensor | None]) -> None:
    """A site's tensors are there and fit its meta (as ``wire`` checks its columns)."""
    missing = [f for f in ("payload", "scales", "valid") if t[f] is None]
    if missing:
        raise RecordFormatError(f"site ({layer}, {site!r}) has no tensor(s) {missing}")
    wrong = {f: x.dtype for f, x in t.items() if x is not None and x.dtype != FIELD_DTYPES[f]}
    if wrong:
        raise RecordFormatError(f"site ({layer}, {site!r}): field dtypes {wrong}, want {FIELD_DTYPES}")
    check_widths(f"site ({layer}, {site!r})", m, {n: tuple(t[n].shape) for n in ("payload", "scales")})


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


def _layout(plan: FlatPlan) -> list[tuple[int, torch.Tensor | None, int]]:
    """(byte offset, uint8 view or None for zero padding, bytes) covering ``[0, plan.total)`` in order."""
    out, pos, dev = [], 0, plan.device
    for meta, views in zip(plan.metas, plan.parts):
        for (_, _, _, rel), v in zip(meta["tensors"], views):
            start = meta["offset"] + rel
            if start > pos:
                out.append((pos, None, start - pos))
            out.append((start, v if v.device == dev else v.to(dev), v.numel()))
            pos = start + v.numel()
        end = meta["offset"] + meta["nbytes"]
        if end > pos:
            out.append((pos, None, end - pos))
            pos = end
    return out


def write_flat(plan: FlatPlan, out: torch.Tensor) -> torch.Tensor:
    """Write the planned tensors into ``out`` (uint8, >= plan.total bytes, any device); returns the used slice.

    Host to host: one ``memmove`` per tensor (single-threaded memcpy, no per-op thread-pool wake-ups).
    Otherwise one ``torch.cat`` on the samples' device, into ``out`` when it is there, else into a
    temporary followed by one bulk copy. Padding bytes are zero.
    """
    if out.dtype != torch.uint8 or out.numel() < plan.total:
        raise ValueError(f"out must be uint8 with >= {plan.total} bytes, got {out.dtype} {out.numel()}")
    used = out[: plan.total]
    if plan.total == 0:
        return used
    layout = _layout(plan)
    if used.device.type == "cpu" and plan.device.type == "cpu" and used.is_contiguous():
        base = used.data_ptr()
        for off, v, n in layout:
            if v is None:
                ctypes.memset(base + off, 0, n)
            else:
                ctypes.memmove(base + off, v.data_ptr(), n)  # v: contiguous uint8 view of n bytes
        return used
    zeros = torch.zeros(ALIGN, dtype=torch.uint8, device=plan.device)
    pieces = [zeros[:n] if v is None else v for _, v, n in layout]
    if used.device == plan.device:
        torch.cat(pieces, out=used)
    else:  # a host target must be complete on return: blocking copy
        used.copy_(torch.cat(pieces), non_blocking=used.is_cuda)
    return used


def flatten(samples: Sequence[SampleGuidance], device=None) -> tuple[list[dict], torch.Tensor]:
    """(metas, one uint8 buffer) holding ``samples``; padding bytes are zero."""
    plan = plan_flat(samples)
    device = torch.device(device) if device is not None else plan.device
    if device.type == "cpu":
        buf = host_buffer(plan.total)
    else:
        buf = torch.empty(plan.total, dtype=torch.uint8, device=device)
    return plan.metas, write_flat(plan, buf)


def host_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """(host tensor, a memoryview of its bytes): a contiguous host tensor is read in place, anything else is
    copied first. Keep the returned tensor alive while the view is used."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t, memoryview((ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr()) if t.nbytes else b"")


def checksum(buf: torch.Tensor) -> str:
    """``"crc32:%08x"`` of a tensor's bytes (read in place when it is a contiguous host tensor)."""
    t, view = host_bytes(buf)
    return f"{CHECKSUM}:{zlib.crc32(view):08x}"


_PARALLEL_BYTES = 1 << 24
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): rebuilt in a forked child


def checksums(spans: Sequence[torch.Tensor]) -> list[str]:
    """``checksum`` of each span; from 16 MiB in total, spans are hashed by a few threads (zlib releases the GIL)."""
    global _pool
    if len(spans) < 2 or sum(s.numel() * s.element_size() for s in spans) < _PARALLEL_BYTES:
        return [checksum(s) for s in spans]
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="guidance-crc"))
    return list(_pool[1].map(checksum, spans))


def _spans(metas: Sequence[dict], buf: torch.Tensor) -> list[torch.Tensor]:
    return [buf[int(m["offset"]) : int(m["offset"]) + int(m["nbytes"])] for m in metas]


def add_checksums(metas: list[dict], buf: torch.Tensor) -> None:
    """Store each sample's checksum (over its span of ``buf``) in its meta (a device ``buf`` is read back once)."""
    host = buf if buf.device.type == "cpu" else buf.cpu()
    for m, c in zip(metas, checksums(_spans(metas, host))):
        m["checksum"] = c


def unflatten_one(meta: dict, span: torch.Tensor, *, verify: bool = False) -> SampleGuidance:
    """One sample from its own span of a flat buffer (views into ``span``)."""
    if span.numel() != meta.get("nbytes", -1):
        raise RecordFormatError(
            f"sample {meta.get('sample_id')}: {span.numel()} bytes, header says {meta.get('nbytes')}"
        )
    if verify and "checksum" in meta and checksum(span) != meta["checksum"]:
        raise RecordFormatError(f"sample {meta['sample_id']}: checksum mismatch (corrupt or partial transfer): "
                                f"got {checksum(span)}, header says {meta['checksum']}")
    tensors, end = {}, 0  # (``plan_flat``'s layout: tensors in order, each after the one before)
    try:
        for name, dt, shape, rel in meta["tensors"]:
            if name in tensors:  # (the later entry replaced the earlier one: a site lost its tensor or took another's)
                raise RecordFormatError(f"tensor {name} is in the table twice")
            dtype = DTYPES[dt]
            if not (is_integer(rel) and rel >= 0 and isinstance(shape, (list, tuple))
                    and all(is_integer(d) and d >= 0 for d in shape)):  # (a negative offset would slice from the end)
                raise RecordFormatError(f"tensor {name}: offset {rel!r} and shape {shape!r} must be ints >= 0")
            n = math.prod(shape) * dtype.itemsize  # (Python ints: a huge shape cannot overflow)
            if rel % ALIGN or rel < end or rel + n > span.numel():  # (an entry moved onto its neighbour's bytes)
                raise RecordFormatError(f"tensor {name} at {rel}+{n} outside {span.numel()} bytes, off the "
                                        f"{ALIGN}-byte alignment or over the tensor before it (which ends at {end})")
            tensors[name] = span[rel : rel + n].view(dtype).view(shape)
            end = rel + n
    except (KeyError, TypeError, ValueError) as e:
        raise RecordFormatError(f"sample {meta.get('sample_id')}: bad tensor table: {e}") from e
    return sample_from_tensors(meta, tensors)


def unflatten(metas: Sequence[dict], buf: torch.Tensor, *, verify: bool = False) -> list[SampleGuidance]:
    """Inverse of ``flatten``: samples whose tensors are views into ``buf``."""
    for m in metas:
        where = f"sample {m.get('sample_id')!r}"
        off, n = _int(m.get("offset"), f"{where}: offset"), _int(m.get("nbytes"), f"{where}: nbytes")
        if off < 0 or off % ALIGN or off + n > buf.numel():  # (off the alignment: a raw RuntimeError from view)
            raise RecordFormatError(f"sample {m.get('sample_id')} spans {off}+{n}, buffer has {buf.numel()} bytes "
                                    f"(samples start at {ALIGN}-byte aligned offsets)")
    if verify:  # every checksum before any sample is built: all or nothing
        checked = [m for m in metas if "checksum" in m]
        host = buf if buf.device.type == "cpu" else buf.cpu()  # one read-back for all samples
        for m, got in zip(checked, checksums(_spans(checked, host))):
            if got != m["checksum"]:
                raise RecordFormatError(f"sample {m['sample_id']}: checksum mismatch (corrupt or partial transfer): "
                                        f"got {got}, header says {m['checksum']}")
    return [unflatten_one(m, buf[int(m["offset"]) : int(m["offset"]) + int(m["nbytes"])]) for m in metas]
