"""Weight sync from the trainer to a rollout backend: BF16 or packed FP4 routed experts.

Both paths take a stream of (HF checkpoint name, tensor) — e.g. ``export_hf_weights`` of the
Megatron model — and call ``backend.update_weights`` (in-place copies on the rollout side).

  bf16  every tensor is sent in ``dtype`` (default bfloat16); a rollout in FP4 mode quantizes
        the routed experts itself.
  fp4   routed-expert weights are quantized here with ``TraceConfig.weight_quantizer()``, from
        the trainer's own values (so the codes are the trainer's fake-quant codes bit for bit),
        and sent as packed codes + block scales + global amax; everything else as in bf16.
        fc1 = [gate; up] is quantized as one matrix (Megatron's ``linear_fc1``) and sent as its
        gate and up row halves sharing the amax.

``sync_byte_counts`` gives the bytes each path moves without syncing.

Robustness (USER_NEEDS.md §9): ``sync_weights`` moves the stream in buckets of at most
``bucket_bytes`` (a tensor larger than that travels alone) into staging buffers on the engine's
device, and applies nothing until the whole stream arrived: then one ``update_weights`` call, which
validates every tensor before copying any. A stream that fails or runs past ``timeout_s`` raises
``WeightSyncError`` / ``WeightSyncTimeoutError`` and leaves the rollout on its previous complete
weights and version. The time of each sync is logged and returned (``SyncStats.seconds``). The
deadline is checked between tensors; a transport that blocks inside one transfer is bounded by its
own timeout (e.g. the NCCL group's). A ``version`` at or below the rollout's ``policy_version`` raises
``ValueError`` before the stream is read (versions only go up, unless ``reset=True``: see
``rollout.base.next_policy_version``).
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..formats import FP4Tensor, NonFiniteError, Quantizer
from ..formats.block import FLOAT_DTYPES
from ..kernels import ops
from ..rollout.base import RolloutBackend, WeightValue, is_int, next_policy_version
from ..rollout.experts import fp4_nbytes
from ..rollout.hf_weights import expert_name, parse_expert_name, split_fc1

logger = logging.getLogger(__name__)

SYNC_FORMATS = ("bf16", "fp4")
DEFAULT_BUCKET_BYTES = 512 << 20  # slime's default bucket (USER_NEEDS.md §9)
ALIGN = 16
QUANT_BATCH_BYTES = 256 << 20
"""Input bytes of expert weights quantized per stacked call in ``fp4_stream``."""


class WeightSyncError(RuntimeError):
    """A weight sync did not complete; the rollout still serves its previous complete weights."""


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A weight sync ran past its ``timeout_s``; nothing was applied."""


def value_nbytes(value: WeightValue) -> int:
    """Bytes a tensor or FP4 tensor occupies on the wire."""
    if isinstance(value, FP4Tensor):
        return fp4_nbytes(value)
    return value.numel() * value.element_size()


@dataclass
class SyncStats:
    """Bytes and tensors of one sync."""

    fmt: str
    tensors: int = 0
    bytes_experts: int = 0
    bytes_other: int = 0
    buckets: int = 0
    seconds: float = 0.0

    @property
    def bytes_total(self) -> int:
        return self.bytes_experts + self.bytes_other

    def add(self, name: str, value: WeightValue) -> None:
        self.tensors += 1
        if parse_expert_name(name) is not None:
            self.bytes_experts += value_nbytes(value)
        else:
            self.bytes_other += value_nbytes(value)

    def as_dict(self, prefix: str = "sync") -> dict[str, float]:
        p = f"{prefix}/{self.fmt}"
        return {f"{p}/bytes_total": float(self.bytes_total), f"{p}/bytes_experts": float(self.bytes_experts),
                f"{p}/bytes_other": float(self.bytes_other), f"{p}/tensors": float(self.tensors),
                f"{p}/buckets": float(self.buckets), f"{p}/seconds": self.seconds}


def _check_dtype(dtype) -> None:
    """The floating-point tensors of a sync are sent in ``dtype``: one the FP4 quantizer takes (or None: as given).
    Another (an integer dtype, bool) would truncate every weight, which the rollout then copied in as it came."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {FLOAT_DTYPES} or None (as given): the weights are sent "
                         "in it (pass the trainer's own dtype)")


def _layer_set(bf16_layers) -> frozenset[int]:
    """``bf16_layers`` as a set of layer numbers; a string, a bare int or a non-integer layer is refused by name (a
    string's characters matched no layer: every expert went as FP4)."""
    if isinstance(bf16_layers, str | bytes) or not isinstance(bf16_layers, Iterable) \
            or not all(is_int(x) and x >= 0 for x in bf16_layers):
        raise ValueError(f"bf16_layers={bf16_layers!r} must be a collection of layer numbers (ints >= 0): the layers "
                         "whose routed experts stay BF16 (the rollout's bf16_expert_layers)")
    return frozenset(int(x) for x in bf16_layers)


def _cast(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    _check_dtype(dtype)
    return value.detach().to(dtype) if dtype is not None and value.is_floating_point() else value.detach()


def bf16_stream(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor cast to ``dtype``."""
    for name, value in named:
        yield name, _cast(value, dtype)


def fp4_stream(named: Iterable[tuple[str, torch.Tensor]], quantizer: Quantizer,
               dtype: torch.dtype | None = torch.bfloat16, bf16_layers: Collection[int] = (), kernel: str = "auto",
               batch_bytes: int = QUANT_BATCH_BYTES) -> Iterator[tuple[str, WeightValue]]:
    """Routed-expert weights as FP4, quantized from their values cast to ``dtype`` (what a ``dtype`` trainer's
    forward fake-quantizes, and what a rollout quantizes from a ``bf16_stream``; ``dtype=None``: as given), the
    rest cast to ``dtype``.

    ``bf16_layers``: layers whose experts stay BF16 (``TraceConfig.exclude_modules``; the rollout's
    ``bf16_expert_layers``): their expert weights are cast like the rest. ``kernel``: as
    ``TraceConfig.kernel`` (``auto``: the bit-exact Triton quantizer for CUDA tensors).
    The experts of one layer are quantized together, up to ``batch_bytes`` of input per call (see
    ``ExpertBatch``): the same bits as one call per expert, without the per-tensor launches and syncs.
    Non-expert tensors may therefore come out ahead of the experts that preceded them. A name given twice raises
    ``ValueError`` when it comes again (which copy is meant is unknown).
    """
    batch = ExpertBatch(quantizer, kernel, batch_bytes)
    bf16_layers = _layer_set(bf16_layers)
    seen: set[str] = set()
    for name, value in named:
        if name in seen:
            raise ValueError(f"fp4_stream: {name!r} was given twice: send each weight once")
        seen.add(name)
        parsed = parse_expert_name(name)
        if parsed is None or parsed[0] in bf16_layers:
            yield name, _cast(value, dtype)
            continue
        yield from batch.add(*parsed, _cast(value, dtype))
    yield from batch.flush()
    if batch.halves:
        raise ValueError(f"expert fc1 halves without their partner (gate_proj and up_proj must both be sent): "
                         f"{sorted(batch.halves)[:5]}")


class ExpertBatch:
    """Expert matrices waiting to be quantized in one stacked call per (shape, layer run).

    fc1 = [gate; up] of one expert is one matrix (Megatron's ``linear_fc1``), sent as its gate and up
    halves sharing the amax. A per-tensor global amax becomes a per-row amax equal to each expert's own
    max|w|, so every element sees the same scale as in a per-expert call; a batch with an all-zero or
    non-finite expert is quantized expert by expert instead (the per-tensor path's own rules apply).
    The batch is flushed when it holds ``batch_bytes`` of input, when experts of another layer arrive,
    and at the end of the stream. NaN/Inf in a weight raise ``NonFiniteError`` naming every such weight of the
    batch (HF names, with their NaN/Inf counts), checked eagerly: a sync is rare.
    """

    def __init__(self, quantizer: Quantizer, kernel: str, batch_bytes: int):
        if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 1:
            raise ValueError(f"batch_bytes={batch_bytes!r} must be an int >= 1")
        self.quantizer, self.kernel, self.batch_bytes = quantizer, kernel, batch_bytes
        self.halves: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.ready: list[tuple[list[str], torch.Tensor]] = []  # (names to emit, matrix to quantize)
        self.layer: int | None = None
        self.nbytes = 0

    def add(self, layer: int, e: int, proj: str, w: torch.Tensor) -> Iterator[tuple[str, WeightValue]]:
        if self.layer is not None and layer != self.layer:
            yield from self.flush()
        self.layer = layer
        if proj == "down_proj":
            self._ready([expert_name(layer, e, proj)], w)
        else:
            halves = self.halves.setdefault((layer, e), {})
            halves[proj] = w
            if len(halves) == 2:
                del self.halves[(layer, e)]
                names = [expert_name(layer, e, "gate_proj"), expert_name(layer, e, "up_proj")]
                self._ready(names, torch.cat([halves["gate_proj"], halves["up_proj"]]))
        if self.nbytes >= self.batch_bytes:
            yield from self.flush()

    def _ready(self, names: list[str], w: torch.Tensor) -> None:
        self.ready.append((names, w))
        self.nbytes += w.numel() * w.element_size()

    def flush(self) -> Iterator[tuple[str, WeightValue]]:
        groups: dict[tuple, list[int]] = {}
        for i, (_, w) in enumerate(self.ready):
            groups.setdefault((tuple(w.shape), w.dtype, w.device), []).append(i)
        out: dict[int, FP4Tensor] = {}
        for idx in groups.values():
            try:
                qs = self._quantize([self.ready[i][1] for i in idx])
            except NonFiniteError as err:
                raise NonFiniteError(self._nonfinite(err)) from err
            for i, q in zip(idx, qs):
                out[i] = q
        for i, (names, _) in enumerate(self.ready):
            if len(names) == 1:
                yield names[0], out[i]
            else:
                gate, up = split_fc1(out[i])
                yield names[0], gate
                yield names[1], up
        self.ready, self.nbytes, self.layer = [], 0, None

    def _nonfinite(self, err: NonFiniteError) -> str:
        """The error of a batch holding NaN/Inf: each such weight of the batch by HF name (an fc1 matrix by its
        gate / up halves) with its count (host reads on this failure path only)."""
        bad = []
        for names, w in self.ready:
            halves = w.chunk(len(names))  # [gate; up] -> gate, up
            counts = torch.stack([(~torch.isfinite(h)).sum() for h in halves]).tolist()
            bad += [f"{name} ({n})" for name, n in zip(names, counts) if n]
        return (f"weight sync: {len(bad)} expert weight(s) hold NaN/Inf (count in brackets): {', '.join(bad[:8])}"
                f"{' ...' if len(bad) > 8 else ''}; FP4 has no NaN/Inf: fix them before syncing ({err})")

    def _quantize(self, ws: list[torch.Tensor]) -> list[FP4Tensor]:
        q = self.quantizer
        if len(ws) == 1 or q.rounding != "rne":
            return [ops.quantize(w, q, kernel=self.kernel) for w in ws]
        x = torch.stack(ws)  # [n, rows, K]
        if q.fmt != "nvfp4" or q.per_row:
            t = ops.quantize(x, q, kernel=self.kernel)
            amax = [None if t.global_amax is None else t.global_amax[i] for i in range(len(ws))]
        else:
            g = x.abs().amax(dim=(1, 2)).float()  # [n]: each expert's per-tensor amax
            if not bool(torch.isfinite(g).all() & (g > 0).all()):
                return [ops.quantize(w, q, kernel=self.kernel) for w in ws]
            t = ops.quantize(x, q, global_amax=g[:, None, None].expand(*x.shape[:-1], 1), kernel=self.kernel)
            amax = list(g.unbind(0))
        return [FP4Tensor(codes=t.codes[i], block_scales=t.block_scales[i], global_amax=amax[i],
                          shape=tuple(ws[i].shape), fmt=t.fmt) for i in range(len(ws))]


def make_stream(named, fmt: str, quantizer: Quantizer | None = None, dtype: torch.dtype = torch.bfloat16,
                bf16_layers: Collection[int] = (), kernel: str = "auto"):
    if fmt not in SYNC_FORMATS:
        raise ValueError(f"fmt={fmt!r} is not one of {SYNC_FORMATS}")
    _check_dtype(dtype)  # (here, before the stream is read)
    bf16_layers = _layer_set(bf16_layers)  # (a one-shot iterator read once)
    if fmt == "fp4":
        if quantizer is None:
            raise ValueError("fmt='fp4' needs the weight quantizer (TraceConfig.weight_quantizer())")
        return fp4_stream(named, quantizer, dtype, bf16_layers, kernel)
    return bf16_stream(named, dtype)


# ---- buckets ------------------------------------------------------------------------------------
def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _parts(value: WeightValue) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, FP4Tensor):
        parts = [("codes", value.codes), ("block_scales", value.block_scales)]
        return parts + ([("global_amax", value.global_amax)] if value.global_amax is not None else [])
    return [("tensor", value)]


@dataclass
class WeightBucket:
    """Several weights in one flat uint8 buffer (what one transfer moves); ``values()`` views it back."""

    buffer: torch.Tensor
    entries: list[dict] = field(default_factory=list)

    @classmethod
    def pack(cls, items: list[tuple[str, WeightValue]], device: torch.device | str = "cpu") -> WeightBucket:
        layout, off = [], 0
        for name, value in items:
            parts = []
            for key, t in _parts(value):
                parts.append((key, t.dtype, tuple(t.shape), off))
                off = _align(off + t.numel() * t.element_size())
            meta = {"fmt": value.fmt, "shape": tuple(value.shape)} if isinstance(value, FP4Tensor) else {}
            layout.append({"name": name, "parts": parts, **meta})
        buf = torch.zeros(off, dtype=torch.uint8, device=device)
        for (_, value), e in zip(items, layout):
            for (_, t), (_, _, _, o) in zip(_parts(value), e["parts"]):
                src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                buf[o : o + src.numel()].copy_(src)
        return cls(buf, layout)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def values(self) -> list[tuple[str, WeightValue]]:
        out = []
        for e in self.entries:
            t = {key: self.buffer[o : o + _nbytes(dt, shape)].view(dt).view(shape) for key, dt, shape, o in e["parts"]}
            if "fmt" in e:
                out.append((e["name"], FP4Tensor(codes=t["codes"], block_scales=t["block_scales"],
                                                 global_amax=t.get("global_amax"), shape=e["shape"], fmt=e["fmt"])))
            else:
                out.append((e["name"], t["tensor"]))
        return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def iter_buckets(stream: Iterable[tuple[str, WeightValue]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, WeightValue]]]:
    """Group a stream into lists of at most ``bucket_bytes`` wire bytes (an oversized tensor alone)."""
    _check_bucket_bytes(bucket_bytes)
    return _buckets(stream, bucket_bytes)


def _check_bucket_bytes(bucket_bytes) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an int >= 1")


def _buckets(stream, bucket_bytes: int) -> Iterator[list[tuple[str, WeightValue]]]:
    bucket, size = [], 0
    for name, value in stream:
        n = value_nbytes(value)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, value))
        size += n
    if bucket:
        yield bucket


def sync_weights(backend: RolloutBackend, named: Iterable[tuple[str, torch.Tensor]], *, fmt: str = "bf16",
                 quantizer: Quantizer | None = None, dtype: torch.dtype = torch.bfloat16,
                 version: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float | None = None, recipe=None, bf16_layers: Collection[int] = (),
                 kernel: str = "auto", clock: Callable[[], float] = time.monotonic, reset: bool = False) -> SyncStats:
    """Send ``named`` weights to ``backend`` (BF16 or FP4 experts; ``bf16_layers`` keep BF16 experts) in buckets;
    returns what was moved.

    All-or-nothing: buckets are staged on the backend's device and applied by one ``update_weights``
    after the stream completed within ``timeout_s`` seconds (None: no limit). ``recipe``: the
    trainer's ``QuantRecipe`` for this version, passed to ``update_weights`` (checked there); ``dtype`` and the FP4
    ``quantizer`` must then be the recipe's (an fp32 trainer's weights rounded to bf16 on the wire, or MXFP4 codes of
    another scale rule, differ from what it computes with).
    ``version``: strictly greater than the backend's ``policy_version`` (None: +1), checked before the stream
    is read; ``reset=True`` sets any version on purpose (a run's first sync, a resume or rollback to a
    checkpoint: see ``rollout.base.next_policy_version``) and is passed to ``update_weights``.
    """
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
                                  or not timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds > 0 or None")
    if recipe is not None:
        _check_recipe_args(recipe, fmt, quantizer, dtype)
    stats, t0 = SyncStats(fmt), clock()
    device = getattr(backend, "device", "cpu")
    staged: list[WeightBucket] = []
    before = getattr(backend, "policy_version", None)
    if before is not None:  # a stale version fails before anything is staged (the backend checks it again)
        next_policy_version(before, version, reset=reset)

    def progress() -> str:
        return (f"after {stats.tensors} tensors ({stats.bytes_total / 1e6:.2f} MB) in {len(staged)} bucket(s); "
                f"the rollout keeps its previous weights (version {before})")

    def check_deadline() -> None:
        if timeout_s is not None and clock() - t0 > timeout_s:
            raise WeightSyncTimeoutError(f"weight sync ({fmt}) exceeded timeout_s={timeout_s} " + progress())

    def received(tensors: Iterable[tuple[str, WeightValue]]) -> Iterator[tuple[str, WeightValue]]:
        for name, value in tensors:  # the deadline between tensors, not only between buckets (a whole model fits one)
            stats.add(name, value)
            check_deadline()
            yield name, value

    # bad arguments raise here, before anything is sent
    stream = iter_buckets(received(make_stream(named, fmt, quantizer, dtype, bf16_layers, kernel)), bucket_bytes)
    try:
        for items in stream:
            staged.append(WeightBucket.pack(items, device))
            check_deadline()
    except WeightSyncError:
        raise
    except Exception as e:
        raise WeightSyncError(f"weight sync ({fmt}) failed {progress()}: {type(e).__name__}: {e}") from e
    check_deadline()
    kw = ({"recipe": recipe} if recipe is not None else {}) | ({"reset": True} if reset else {})
    backend.update_weights([v for b in staged for v in b.values()], version=version, **kw)
    stats.buckets, stats.seconds = len(staged), clock() - t0
    logger.info("weight sync (%s): %d tensors, %.2f MB (experts %.2f MB) in %d bucket(s), %.3f s, version %s",
                fmt, stats.tensors, stats.bytes_total / 1e6, stats.bytes_experts / 1e6, stats.buckets, stats.seconds,
                getattr(backend, "policy_version", None))
    return stats


def _check_recipe_args(recipe, fmt: str, quantizer: Quantizer | None, dtype: torch.dtype) -> None:
    """The sync's ``dtype`` and FP4 ``quantizer`` are the trainer recipe's: the rollout's recipe check compares the
    recipe with its own config and model dtype, but uses the FP4 codes it is sent as they are and the BF16 values as
    they arrive, so weights cast or quantized otherwise would not be what the trainer computes with."""
    from ..manifest import scale_rule_name

    if str(dtype).removeprefix("torch.") != recipe.dtype:
        raise ValueError(f"dtype={dtype}: the trainer's recipe says it quantizes its weights from {recipe.dtype}; "
                         "sent in another dtype the weights, and the FP4 codes of them, are not what the trainer "
                         f"computes with: pass dtype=torch.{recipe.dtype}")
    if fmt == "fp4" and quantizer is not None:
        rule = scale_rule_name(quantizer.fmt, quantizer.scale_rule)
        if (quantizer.fmt, rule, quantizer.per_row) != (recipe.format, recipe.scale_rule, False):
            raise ValueError(f"quantizer={quantizer} is not the trainer recipe's weight quantizer (format="
                             f"{recipe.format!r}, scale_rule={recipe.scale_rule!r}, per-tensor amax): its FP4 codes "
                             "would not be the trainer's fake-quant codes; pass TraceConfig.weight_quantizer()")


def sync_byte_counts(named: Iterable[tuple[str, torch.Tensor]], quantizer: Quantizer,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, SyncStats]:
    """Bytes per sync of both paths for the same weights: ``{"bf16": SyncStats, "fp4": SyncStats}``."""
    named = list(named)
    out = {}
    for fmt in SYNC_FORMATS:
        stats = SyncStats(fmt)
        for name, value in make_stream(named, fmt, quantizer, dtype):
            stats.add(name, value)
        out[fmt] = stats
    return out
