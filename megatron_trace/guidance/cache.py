"""Bounded host cache of guidance records between rollout and trainer, spilling to disk.

Rollout side: ``put(step, samples)`` flattens a rollout batch into a preallocated device staging
buffer and copies it to pinned host memory on a side CUDA stream (``non_blocking``; ``get``
waits on the copy's event). On CPU the flat buffer is written on the host directly (a huge-page
``serial.host_buffer``, one ``memmove`` per tensor). Samples that do not fit under ``budget_bytes``
of host memory go to one safetensors shard per ``put`` (one rollout batch) in ``cache_dir`` (see
``shards``: atomic, checked on load).

A whole batch straight from ``records.split_batch`` (its samples are views of one columnar
``packed.PackedGuidance``) that fits in memory is kept as those columns, copied to the host once
per field; ``assemble`` then fills a trainer micro-batch from them with a few index operations per
site (``packed_assemble``) instead of per-sample work.

Trainer side: ``get(step, sample_ids)`` returns only the samples a micro-batch needs (loading
just those from a shard), ``None`` for samples the step does not have (the trainer then falls
back and counts ``missing``); ``assemble(step, sample_ids, token_ids, ...)`` returns the
micro-batch's batch-major guidance directly (``records.assemble`` semantics).
``drop(step)`` frees a consumed step; ``invalidate(step)`` removes
an interrupted step so none of its partial data is used. Samples returned from host memory are
views of the step's buffer (kept alive by the views after ``drop``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import TraceConfig
from .layout import PackedLayout
from .packed import Column, PackedGuidance, source_of
from .packed_assemble import assemble_packed
from .records import FC2, SampleGuidance, SiteRecord, assemble, is_integer, sample_id_list
from .serial import FlatPlan, host_buffer, plan_flat, unflatten_one, write_flat
from .shards import (
    SHARD_PREFIX,
    forget_tables,
    is_stale,
    load_samples,
    owner_tag,
    remove_stale_tmp,
    shard_index,
    shard_path,
    write_shard,
)

logger = logging.getLogger(__name__)


@dataclass
class _Chunk:
    """The in-memory part of one ``put``: a host buffer and where each sample sits in it."""

    buf: torch.Tensor
    metas: dict[int, dict]
    event: object = None  # torch.cuda.Event of the device -> host copy, None on CPU


@dataclass
class _Step:
    chunks: list[_Chunk] = field(default_factory=list)
    shards: list[tuple[Path, dict[int, dict]]] = field(default_factory=list)  # (path, sample_id -> meta)
    shard_bytes: int = 0  # the shards' sizes as written (what ``disk_bytes`` counts for this step)
    sample_ids: set[int] = field(default_factory=set)
    packed: list[tuple[PackedGuidance, int]] = field(default_factory=list)  # (host columns, bytes)
    views: dict[int, SampleGuidance] = field(default_factory=dict)  # sample id -> view of ``packed``
    keys: set = field(default_factory=set)  # every (layer, site) a put of this step recorded
    topk: int | None = None  # the FC2 records' top-k (rows per token at expert_fc2_in)

    def add_keys(self, whole: PackedGuidance | None, samples: Sequence[SampleGuidance]) -> None:
        """Note the keys (and FC2 top-k) of a put: ``assemble`` counts a micro-batch's rows at all of the step's."""
        if whole is not None:
            found = [(c.key, c.fields["valid"].shape[-1]) for c in whole.columns]
        else:
            found = [(k, r.valid.shape[-1]) for s in samples for k, r in s.sites.items()]
        self.keys.update(k for k, _ in found)
        if self.topk is None:
            self.topk = next((int(n) for k, n in found if k[1] == FC2), None)


def _columns_nbytes(p: PackedGuidance) -> int:
    return sum(t.nbytes for c in p.columns for t in c.fields.values())


def _to_host(p: PackedGuidance) -> PackedGuidance:
    """The same columns with every field on the host (host fields are kept: the split made them fresh)."""
    cols = [Column(c.key, c.members, c.starts, {k: t if t.device.type == "cpu" else t.cpu() for k, t in
                                                c.fields.items()}, c.meta) for c in p.columns]
    return PackedGuidance(p.table, cols)


class _HostStager:
    """Flat bytes of a batch -> host. CUDA: device staging buffer + async copy to pinned memory."""

    def __init__(self):
        self.staging: torch.Tensor | None = None
        self.stream = None
        self.last_event = None

    def to_host(self, plan: FlatPlan) -> tuple[torch.Tensor, object]:
        dev = plan.device
        if dev.type != "cuda":
            host = host_buffer(plan.total)
            write_flat(plan, host)  # one memmove per tensor
            return host, None
        cur = torch.cuda.current_stream(dev)
        if self.last_event is not None:
            cur.wait_event(self.last_event)  # the previous copy has finished reading the staging buffer
        if self.staging is None or self.staging.device != dev or self.staging.numel() < plan.total:
            size = max(plan.total, 2 * (0 if self.staging is None else self.staging.numel()))
            logger.info("guidance staging buffer: %.1f MiB on %s", size / 2**20, dev)
            self.staging = torch.empty(size, dtype=torch.uint8, device=dev)
            self.stream = torch.cuda.Stream(dev)
        write_flat(plan, self.staging)
        host = torch.empty(plan.total, dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            host.copy_(self.staging[: plan.total], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.last_event = event
        return host, event


def _step(step) -> int:
    """An RL step number (any int: the driver's sentinel step is negative) as a Python int; a float (1.5 was kept as
    step 1 in memory, refused by a spill's shard name), string or bool is refused, naming it."""
    if not is_integer(step):
        raise ValueError(f"step={step!r} is not an int (the RL step the guidance belongs to)")
    return int(step)


def _check_samples(samples: Sequence[SampleGuidance]) -> None:
    """Each sample a ``SampleGuidance`` whose sites hold ``SiteRecord``s (a bare AttributeError from the
    serialisation before), naming the first that is not."""
    for i, s in enumerate(samples):
        if not isinstance(s, SampleGuidance):
            raise TypeError(f"put: samples[{i}] must be a SampleGuidance, got {type(s).__name__}")
        bad = next(((k, r) for k, r in s.sites.items() if not isinstance(r, SiteRecord)), None)
        if bad is not None:
            raise TypeError(f"put: sample {s.sample_id} site {bad[0]!r} must be a SiteRecord, got "
                            f"{type(bad[1]).__name__}")


class GuidanceCache:
    """Host cache of ``SampleGuidance`` per RL step under a byte budget, spilling to ``cache_dir``."""

    def __init__(self, budget_bytes: int, cache_dir: str | Path | None = None):
        if not is_integer(budget_bytes) or budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes!r} must be an int >= 0 (bytes of host memory)")
        self.budget_bytes = int(budget_bytes)
        self.cache_dir = Path(cache_dir) if cache_dir else None
        if self.cache_dir is not None and self.cache_dir.exists() and not self.cache_dir.is_dir():
            raise NotADirectoryError(f"cache_dir={str(self.cache_dir)!r} is a file: give a directory to spill "
                                     "guidance shards into (made if missing)")
        self.owner = owner_tag()  # in its shards' names: other caches on cache_dir (ranks, runs) keep theirs
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(self.cache_dir)
            old = [p for p in self.cache_dir.glob(f"{SHARD_PREFIX}*.safetensors") if is_stale(p)]
            if old:  # a finished or crashed run's (never read: its samples are not this run's)
                logger.warning("guidance cache_dir %s holds %d shard(s) (%.1f MiB) of an earlier run: they are not "
                               "read; delete them or use another cache_dir",
                               self.cache_dir, len(old), sum(p.stat().st_size for p in old) / 2**20)
        self._steps: dict[int, _Step] = {}
        self._stager = _HostStager()
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.disk_bytes = 0

    @classmethod
    def from_config(cls, config: TraceConfig) -> GuidanceCache:
        return cls(int(config.cache_budget_mb * 2**20), config.cache_dir or None)

    @property
    def steps(self) -> list[int]:
        return sorted(self._steps)

    def stats(self, prefix: str = "cache") -> dict[str, float]:
        return {
            f"{prefix}/host_bytes": float(self.host_bytes),
            f"{prefix}/peak_host_bytes": float(self.peak_host_bytes),
            f"{prefix}/disk_bytes": float(self.disk_bytes),
            f"{prefix}/steps": float(len(self._steps)),
        }

    # ---- rollout side -----------------------------------------------------------------------
    def put(self, step: int, samples: Sequence[SampleGuidance] | PackedGuidance) -> None:
        """Store one rollout batch of ``step`` (samples, or a whole batch's columns from ``records.pack_guidance``);
        may be called several times per step. A put that raises (e.g. its spill fails) keeps none of its samples."""
        step = _step(step)
        whole = samples if isinstance(samples, PackedGuidance) else None
        ids = list(whole.table.ids) if whole is not None else [s.sample_id for s in samples]
        # a new step enters ``_steps`` once it holds samples (``_keep``): a put that raises (a duplicate id, a bad
        # sample, a failed spill) leaves no empty step behind, whose rows would all fall back as ``missing``
        st = self._steps.get(step) or _Step()
        dup = sorted((set(ids) & st.sample_ids) | {i for i, n in Counter(ids).items() if n > 1})  # (not quadratic)
        if dup:
            raise ValueError(f"step {step} already has sample id(s) {dup}")
        if whole is None:
            src = source_of(samples)
            if src is not None and src[1] == list(range(len(src[0].table))):  # a whole split batch
                whole = src[0]
        if whole is not None:  # keep its columns
            nbytes = _columns_nbytes(whole)
            if nbytes <= self.budget_bytes - self.host_bytes:
                st.packed.append((_to_host(whole), nbytes))
                st.views = {}  # rebuilt by the next get, with this part's samples
                self._account(nbytes)
                self._keep(step, st, ids, whole, ())
                return
            if isinstance(samples, PackedGuidance):
                samples = samples.to_samples()
        _check_samples(samples)
        plan = plan_flat(samples)
        n_mem = self._fit_in_memory(plan)
        if n_mem < len(samples) and self.cache_dir is None:  # fail before anything of this put is kept
            raise RuntimeError(
                f"guidance for step {step} exceeds the host budget of {self.budget_bytes} bytes "
                f"({self.host_bytes} held, this put needs {plan.total}) and no cache_dir is set: "
                "set TraceConfig.cache_dir (spill to disk) or raise cache_budget_mb"
            )
        chunk = None
        try:
            if n_mem:
                mem = FlatPlan(plan.metas[:n_mem], plan.parts[:n_mem], sum(m["nbytes"] for m in plan.metas[:n_mem]))
                host, event = self._stager.to_host(mem)
                chunk = _Chunk(host, {m["sample_id"]: m for m in mem.metas}, event)
                st.chunks.append(chunk)
                self._account(mem.total)
            if n_mem < len(samples):
                self._spill(step, st, samples[n_mem:])
        except BaseException:  # nothing of a failed put is kept: its samples would shadow those of a retry
            if chunk is not None:
                st.chunks = [c for c in st.chunks if c is not chunk]
                self.host_bytes -= chunk.buf.numel()
            raise
        self._keep(step, st, ids, None, samples)

    def _keep(self, step: int, st: _Step, ids: list[int], whole: PackedGuidance | None,
              samples: Sequence[SampleGuidance]) -> None:
        """A put of ``ids`` (the columns ``whole``, or ``samples``) into ``st`` succeeded: the step (new or not)
        holds them, and notes their keys."""
        st.sample_ids.update(ids)
        st.add_keys(whole, samples)
        self._steps[step] = st

    def _fit_in_memory(self, plan: FlatPlan) -> int:
        """How many leading samples of ``plan`` fit under the budget."""
        free, n = self.budget_bytes - self.host_bytes, 0
        for m in plan.metas:
            if m["nbytes"] > free:
                break
            free -= m["nbytes"]
            n += 1
        return n

    def _spill(self, step: int, st: _Step, samples: Sequence[SampleGuidance]) -> None:
        path = shard_path(self.cache_dir, self.owner, step, len(st.shards))
        size = write_shard(path, samples, step=step)
        st.shards.append((path, shard_index(path)))
        st.shard_bytes += size
        self.disk_bytes += size
        logger.info("guidance step %d: spilled %d samples (%.1f MiB) to %s", step, len(samples), size / 2**20, path)

    def _account(self, delta: int) -> None:
        self.host_bytes += delta
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    # ---- trainer side -----------------------------------------------------------------------
    def get(self, step: int, sample_ids: Sequence[int]) -> list[SampleGuidance | None]:
        """The samples ``sample_ids`` of ``step`` (None where absent). Unknown step: KeyError."""
        st = self._steps.get(_step(step))
        if st is None:
            raise KeyError(f"guidance cache has no step {step} (steps held: {self.steps})")
        sample_ids = sample_id_list(sample_ids)
        if st.packed and not st.views:
            st.views = {s.sample_id: s for p, _ in st.packed for s in p.to_samples()}
        found: dict[int, SampleGuidance] = {sid: st.views[sid] for sid in sample_ids if sid in st.views}
        want = set(sample_ids) - found.keys()
        for chunk in st.chunks:
            hit = want & chunk.metas.keys()
            if hit and chunk.event is not None:
                chunk.event.synchronize()
            for sid in hit:
                m = chunk.metas[sid]
                found[sid] = unflatten_one(m, chunk.buf[m["offset"] : m["offset"] + m["nbytes"]])
        for path, index in st.shards:
            hit = [sid for sid in sample_ids if sid in index and sid not in found]
            if hit:
                found.update(load_samples(path, hit, index))
        return [found.get(sid) for sid in sample_ids]

    def assemble(self, step: int, sample_ids: Sequence[int | None], token_ids: torch.Tensor, *, versions,
                 counter, attention_mask: torch.Tensor | None = None, layout: PackedLayout | None = None) -> dict:
        """``records.assemble`` of the samples ``sample_ids`` (row b trains ``sample_ids[b]``; None: no sample):
        batch-major guidance (with ``layout``, a ``guidance.layout.PackedLayout``: the packed row's [1, T, ...]),
        mismatching or absent rows invalid and counted in ``counter``, at every key the step holds (a micro-batch of
        absent samples alone counts the rows it counts beside present ones). Unknown step: KeyError. From the step's
        columns when all of it was kept as columns, else sample by sample."""
        st = self._steps.get(_step(step))
        if st is None:
            raise KeyError(f"guidance cache has no step {step} (steps held: {self.steps})")
        sample_ids = sample_id_list(sample_ids, rows=True)  # (one lookup rule on every storage path)
        if st.packed and not st.chunks and not st.shards:
            return assemble_packed([p for p, _ in st.packed], sample_ids, token_ids, versions=versions,
                                   counter=counter, attention_mask=attention_mask, layout=layout)
        ids = [sid for sid in sample_ids if sid is not None]
        got = dict(zip(ids, self.get(step, ids)))
        return assemble([None if sid is None else got[sid] for sid in sample_ids], token_ids,
                        versions=versions, counter=counter, attention_mask=attention_mask,
                        keys=sorted(st.keys) or None, topk=st.topk, layout=layout)

    def drop(self, step: int) -> None:
        """Free everything held for ``step`` (memory and shards). Unknown steps are ignored."""
        st = self._steps.pop(_step(step), None)
        if st is None:
            return
        for chunk in st.chunks:
            self.host_bytes -= chunk.buf.numel()
        self.host_bytes -= sum(n for _, n in st.packed)
        self.disk_bytes -= st.shard_bytes  # as counted when written: a shard already gone is uncounted too
        failed = []
        for path, _ in st.shards:  # every one is tried: a shard left behind after an error is named, never forgotten
            forget_tables(path)
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                failed.append(f"{path} ({type(e).__name__}: {e.strerror or e})")
        if failed:
            raise OSError(f"guidance step {step} was dropped, but {len(failed)} of its spilled shard(s) could not be "
                          f"deleted (delete them by hand): {'; '.join(failed)}")

    def close(self) -> None:
        """Drop every step held (their shards deleted): the end of a run. A step whose shards cannot be deleted does
        not keep the others held: each is dropped, then the errors are raised together."""
        errors = []
        for step in self.steps:
            try:
                self.drop(step)
            except OSError as e:
                errors.append(str(e))
        if errors:
            raise OSError("GuidanceCache.close: " + " | ".join(errors))

    def invalidate(self, step: int) -> None:
        """Discard an interrupted step's partial data; a later ``put`` can redo it."""
        if _step(step) in self._steps:
            logger.warning("guidance step %d invalidated: its records are discarded", step)
        self.drop(step)
