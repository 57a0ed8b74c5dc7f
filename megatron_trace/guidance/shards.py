"""Guidance shards on disk: one safetensors file per rollout batch, written atomically, checked on load.

A shard holds the named tensors of several samples (``"{sample_id}/{layer}/{site}/{field}"``,
see ``serial``) and, in the safetensors metadata, the sample metas with a blake2b checksum each
(over the sample's tensors and the rest of its meta: id, version, token hash, layouts) and the total
data length. Writing goes to a temp file in the same directory, is fsynced, then
``os.replace``d into place, so a crash leaves either the old state or a complete shard (plus a
stray ``*.tmp*`` file that ``remove_stale_tmp`` deletes). On load the file length is checked
against its own header and each loaded sample against its checksum: a truncated or half-written
shard raises ``ShardError`` naming the file, never returns partial data. The header is parsed once per version of
the file (``_tensor_table``), not once per load: a step is read back one micro-batch at a time. Loading reads the
requested samples' byte ranges itself (the header is parsed here anyway): safetensors' ``safe_open(...).get_tensor``
keeps ~64 bytes of process memory per call for good (safetensors 0.8), which a run that reloads spilled guidance every
step would accumulate without bound.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import re
import socket
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .records import SampleGuidance, is_integer, sample_id_list
from .serial import host_bytes, sample_from_tensors, sample_to_tensors

logger = logging.getLogger(__name__)

MAGIC = "megatron_trace.guidance_shard"
SHARD_VERSION = "2"  # 2: each checksum covers its sample's meta too


class ShardError(ValueError):
    """A guidance shard on disk is truncated, corrupt or not a guidance shard."""


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("spilling guidance to disk needs safetensors: pip install 'megatron_trace[hf]'") from e
    return st


def tensors_checksum(tensors: dict[str, torch.Tensor], meta: dict | None = None) -> str:
    """blake2b-128 over ``meta`` (its JSON, keys sorted, without a "checksum" key) and then (name, dtype, shape,
    bytes) of each tensor in name order."""
    h = hashlib.blake2b(digest_size=16)
    if meta is not None:
        h.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        host, view = host_bytes(t)  # in place for host tensors, no bytes copy
        h.update(view)
        del view, host
    return h.hexdigest()


def write_shard(path: Path, samples: Sequence[SampleGuidance], *, step: int) -> int:
    """Write ``samples`` (distinct sample ids) to ``path`` atomically; returns the file size in bytes."""
    if not is_integer(step):  # (was written as its str: "True", "1.5")
        raise ValueError(f"step={step!r} must be an int (the training step of the samples)")
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):  # (a repeated id's tensors overwrote the earlier sample's: one sample was lost)
        raise ValueError(f"write_shard: sample ids {sorted({i for i in ids if ids.count(i) > 1})} are given twice; "
                         "a shard holds one sample per id")
    st = _safetensors()
    path = Path(path)
    tensors, metas = {}, []
    for s in samples:
        t, meta = sample_to_tensors(s)
        t = {name: x.detach().cpu().contiguous().clone() for name, x in t.items()}  # no shared storage
        meta["checksum"] = tensors_checksum(t, meta)  # (a re-stamped id, version or hash fails it too)
        metas.append(meta)
        tensors.update({f"{s.sample_id}/{name}": x for name, x in t.items()})
    data_nbytes = sum(x.nbytes for x in tensors.values())
    metadata = {"format": MAGIC, "shard_version": SHARD_VERSION, "step": str(step),
                "data_nbytes": str(data_nbytes), "samples": json.dumps(metas)}
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        st.save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path.stat().st_size


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def read_header(path: Path) -> tuple[dict, dict]:
    """(safetensors header without metadata, our metadata); checks length and magic."""
    return _checked_header(Path(path))[:2]


def _checked_header(path: Path) -> tuple[dict, dict, int]:
    """``read_header`` plus the file offset where the tensor data starts."""
    try:
        return _read_header(path)
    except OSError as e:
        raise ShardError(f"guidance shard {path} cannot be read ({type(e).__name__}: {e}): deleted or moved by "
                         "another process? each cache names its own shards; re-generate this step") from e


def _read_header(path: Path) -> tuple[dict, dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ShardError(f"guidance shard {path} is truncated: {size} bytes, no header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ShardError(f"guidance shard {path} is truncated: header needs {8 + n} bytes, file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ShardError(f"guidance shard {path} has a corrupt header: {e}") from e
    meta = (header.pop("__metadata__", None) or {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ShardError(f"{path} is not a guidance shard: its header is not a JSON object with a metadata object")
    if meta.get("format") != MAGIC:
        raise ShardError(f"{path} is not a guidance shard (metadata format={meta.get('format')!r}, want {MAGIC!r})")
    if meta.get("shard_version") != SHARD_VERSION:
        raise ShardError(f"guidance shard {path} has shard_version={meta.get('shard_version')!r}, this version reads "
                         f"{SHARD_VERSION!r}: written by another megatron_trace version; re-generate this step")
    data_end = max((_header_int(path, f"tensor {k}'s data end", lambda v=v: v["data_offsets"][1])
                    for k, v in header.items()), default=0)
    want = 8 + n + data_end
    if size != want or _header_int(path, "metadata data_nbytes", lambda: meta.get("data_nbytes", -1)) != data_end:
        raise ShardError(
            f"guidance shard {path} is truncated or half-written: {size} bytes on disk, header says {want} "
            f"(data {data_end} bytes, metadata data_nbytes={meta.get('data_nbytes')}); re-generate this step"
        )
    return header, meta, 8 + n


def _header_int(path: Path, what: str, get) -> int:
    """``int(get())``; a damaged header entry (a bare IndexError / KeyError / ValueError before) as ``ShardError``."""
    try:
        return int(get())
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ShardError(f"guidance shard {path}: {what} is not an int ({type(e).__name__}: {e}); re-generate this "
                         "step") from e


def shard_index(path: Path) -> dict[int, dict]:
    """sample_id -> meta (with checksum) of a shard, after the length checks."""
    _, meta = read_header(path)
    try:
        return {int(m["sample_id"]): m for m in json.loads(meta["samples"])}
    except (KeyError, ValueError, TypeError) as e:
        raise ShardError(f"guidance shard {path} has corrupt sample metadata: {e}") from e


def load_samples(
    path: Path, sample_ids: Iterable[int], index: dict[int, dict] | None = None
) -> dict[int, SampleGuidance]:
    """Load only ``sample_ids`` from a shard (others are not read), each checked against its checksum."""
    path = Path(path)
    index = shard_index(path) if index is None else index
    sample_ids = sample_id_list(sample_ids)  # (0.0 or True found sample 0's entry, then "failed its checksum")
    absent = [i for i in sample_ids if i not in index]
    if absent:
        raise KeyError(f"guidance shard {path} has no sample(s) {absent}")
    header, data_start, by_sample = _tensor_table(path)  # the file may have changed since the index was taken
    out = {}
    try:
        with open(path, "rb") as f:
            for sid in sample_ids:
                meta = index[sid]
                names = by_sample.get(str(sid), [])
                tensors = {k.split("/", 1)[1]: _read_tensor(f, path, k, header[k], data_start) for k in names}
                if tensors_checksum(tensors, meta) != meta.get("checksum"):
                    raise ShardError(f"guidance shard {path}: sample {sid} fails its checksum (corrupt data or "
                                     "metadata)")
                out[sid] = sample_from_tensors(meta, tensors)
    except ShardError:
        raise
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as e:  # a damaged header entry or file
        raise ShardError(f"guidance shard {path} cannot be read: {type(e).__name__}: {e}") from e
    return out


_TABLES: OrderedDict[tuple, tuple[dict, int, dict[str, list[str]]]] = OrderedDict()
_TABLES_KEPT = 2
"""The tensor tables of the last shards loaded from, by file version (path, inode, size, mtime, ctime): a step's
shards are read in turn; each table is about 3x its header's JSON (37 MB at 256 samples x 96 guided sites)."""


def _tensor_table(path: Path) -> tuple[dict, int, dict[str, list[str]]]:
    """(header, data start, tensor names per sample id) of a shard, checked (``read_header``) once per version of the
    file: a spilled step is read one micro-batch at a time, and parsing the whole header (every sample's tensors) on
    each load made reading a step back quadratic in its samples. A file rewritten, truncated or replaced since is
    read and checked again; each loaded sample is still checked against its checksum."""
    try:
        st = path.stat()
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except OSError:  # (``_checked_header`` raises the ShardError naming the file)
        key = None
    hit = _TABLES.get(key)
    if hit is None:
        header, _, data_start = _checked_header(path)
        by_sample: dict[str, list[str]] = {}
        for k in header:
            by_sample.setdefault(k.split("/", 1)[0], []).append(k)
        hit = header, data_start, by_sample
        if key is not None:
            _TABLES[key] = hit
            while len(_TABLES) > _TABLES_KEPT:
                _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return hit


def forget_tables(path: Path) -> None:
    """Drop the kept tensor tables of ``path`` (its shard was deleted)."""
    for key in [k for k in _TABLES if k[0] == str(path)]:
        del _TABLES[key]


_DTYPES = {"U8": torch.uint8, "BOOL": torch.bool, "I64": torch.int64, "F32": torch.float32}
"""safetensors dtype names of the tensors a shard holds (``serial.DTYPES``)."""


def _read_tensor(f, path: Path, name: str, info: dict, data_start: int) -> torch.Tensor:
    """Tensor ``name`` of an open shard from its header entry (``dtype``, ``shape``, ``data_offsets``)."""
    dtype = _DTYPES.get(info["dtype"])
    if dtype is None:
        raise ShardError(f"guidance shard {path}: tensor {name} has dtype {info['dtype']!r}, a shard holds "
                         f"{sorted(_DTYPES)}")
    begin, end = (int(v) for v in info["data_offsets"])
    shape = [int(v) for v in info["shape"]]
    if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
        raise ShardError(f"guidance shard {path}: tensor {name} spans bytes {begin}..{end}, its {info['dtype']} "
                         f"shape {shape} needs {math.prod(shape) * dtype.itemsize}")
    buf = bytearray(end - begin)
    f.seek(data_start + begin)
    if f.readinto(buf) != len(buf):
        raise ShardError(f"guidance shard {path} is truncated: tensor {name} ends past the end of the file")
    return torch.frombuffer(buf, dtype=dtype).reshape(shape) if buf else torch.empty(shape, dtype=dtype)


SHARD_PREFIX = "guidance_step"
_OWNED = re.compile(r"^guidance_step-?\d+_(?P<host>[A-Za-z0-9.-]+)-(?P<pid>\d+)-\d+_part\d+\.safetensors")
_caches = itertools.count()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", ".", socket.gethostname()) or "host"


def owner_tag() -> str:
    """A new cache's tag in its shards' names (host, process, instance): caches of several ranks or runs can share
    a ``cache_dir`` without overwriting or deleting each other's shards."""
    return f"{_host()}-{os.getpid()}-{next(_caches)}"


def shard_path(cache_dir: Path, owner: str, step: int, part: int) -> Path:
    return Path(cache_dir) / f"{SHARD_PREFIX}{step:08d}_{owner}_part{part:04d}.safetensors"


def is_stale(path: Path) -> bool:
    """A shard (or its temp file) of a cache no longer running: its process on this host is gone, or its name has no
    owner (an older version's). Another host's shards are never stale here (its processes cannot be seen)."""
    m = _OWNED.match(Path(path).name)
    if m is None:
        return True
    if m["host"] != _host():
        return False
    try:
        os.kill(int(m["pid"]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def remove_stale_tmp(cache_dir: Path, pattern: str = f"{SHARD_PREFIX}*.safetensors.tmp*") -> int:
    """Delete temp files a crashed writer left behind (``is_stale``: a live writer's are kept); returns how many."""
    n = 0
    for p in Path(cache_dir).glob(pattern):
        if is_stale(p):
            p.unlink(missing_ok=True)
            n += 1
    if n:
        logger.warning("removed %d half-written guidance shard temp file(s) in %s", n, cache_dir)
    return n
