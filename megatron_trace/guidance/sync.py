"""Moving guidance records from a rollout rank to trainer ranks over a dedicated process group.

Like the weight-update group of RL frameworks, guidance travels on its own group (``new_group``
over the given global ranks, with its own timeout), NCCL on GPU and gloo on CPU; tensors live on
the backend's device. Per destination and chunk, three messages: a small int64 tensor ``[magic, header
bytes, payload bytes, chunks still to come, transfer number, the header's CRC-32]``, the JSON header as uint8,
then one flat uint8 payload. The transfer number (per destination, from 0) keeps both sides in step: a chunk of
another transfer is an error naming both numbers, and a rejected chunk's transfer is read to its end before
``receive`` raises, so the next transfer starts clean.

Every ``send`` is one transfer to *every* trainer rank, ended either by its last chunk or, when that rank's
share cannot be sent (bad input: it cannot be encoded), by an abort message (magic ``ABORT``, the reason as
header): that rank's ``receive`` raises ``GuidanceSyncError`` with the reason at once (no wait for the timeout)
and both sides stay in step; the other ranks get their guidance, then ``send`` raises naming the failed ranks.
A transport failure (a peer missing, crashed or late: gloo closes the link on a timeout, NCCL's watchdog
aborts) or a message of another transfer leaves the link to that peer unusable: this side marks it broken and
every later transfer with that peer raises at once, saying to recreate ``GuidanceSync`` on both sides (the
other peers of a ``send`` are still served). So the two sides never silently disagree on what was transferred.
The chunk travels in columns (``guidance.wire``, protocol 6): per (layer, site) and field one tensor
holding the rows of all the chunk's samples, the same per routing layer, and a compact header (per
sample: id, version, token hash, tokens; per column: format, mode, row shape, dtypes, offsets,
checksums). Work is per column, not per sample, so a step of many short samples costs about its bytes.

Memory (USER_NEEDS.md §7): every sample's guidance *and routing* go to one trainer rank only (never
broadcast whole), in chunks of at most ``chunk_bytes`` (one sample may exceed it), and the sender
waits for a chunk before building the next, so its extra memory is one chunk, not the batch.
``last_stats`` reports bytes, chunks and the peak bytes the transfer buffers held on this rank.

Destinations: each sample goes whole to the data-parallel rank that trains it (a user mapping
``sample_id -> rank``, default round-robin over ``dsts`` in send order). FC2 rows travel with
their sample too: we leave their expert-parallel routing to the Megatron dispatcher (the
trainer's MoE layer permutes FC2 guidance rows with the same token dispatch as the activations),
so no second, expert-owner exchange is needed here.

The payload is written in place into one buffer on the group's device (a huge-page host buffer for
gloo): one ``index_select`` per field from the columns that ``split_batch`` / ``split_routing`` samples
are views of (one ``cat`` of the samples' tensors otherwise); with ``verify`` every field carries a
CRC-32 (``serial.checksum``, read in place), and so does the header (in the size message: the header names the
layers, sites and samples the fields belong to). The receiver gets a ``GuidanceShard`` of columns (views of
the payload): ``shard.assemble`` / ``shard.assemble_routing`` build the trainer's batch-major tensors
with a few index operations per site; ``shard.samples`` / ``shard.routing`` give per-sample views.

Nothing is partially applied: ``receive`` returns only after the whole payload arrived and its
sizes, offsets (and, with ``verify``, the header's and every field's checksum) were checked; otherwise it raises
``GuidanceSyncError``. A receiver with ``verify`` refuses fields without a checksum (a sender with
``verify=False``): ``verify=False`` on both sides trusts the transport, sizes included.
A peer that never sends makes ``receive`` fail after the group timeout
(gloo) with an error naming the rank; NCCL enforces the timeout through its watchdog.
``GuidanceSync`` must be constructed by every process of the default group (``new_group`` is
collective), with the same arguments.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from . import wire
from .records import SampleGuidance, is_integer, tensor_bytes
from .routing import SampleRouting
from .serial import RecordFormatError, host_buffer
from .transfer import GuidanceShard, TransferStats, _Unit, _units, assign_destinations, chunk_units

logger = logging.getLogger(__name__)

MAGIC = 0x54524143  # "TRAC"
ABORT = 0x54524158  # "TRAX": the sender ends the transfer without its data; the header is the reason (UTF-8)
SIZES = 6  # the size message: magic, header bytes, payload bytes, chunks to come, transfer number, header CRC-32
NO_CRC = -1  # the size message's header CRC from a sender with verify=False
MAX_REASON = 4096  # bytes of an abort's reason
PROTOCOL = 6  # 6: abort messages; 5: + the header's CRC-32; 4: columnar chunks (wire.py), CRC-32 per field;
# 3: per-sample tensors


class GuidanceSyncError(RuntimeError):
    """A guidance transfer failed (peer missing or timed out, bad header, corrupt payload, aborted by the sender)."""


class GuidanceSync:
    """A process group from rollout rank ``src`` to trainer ranks ``dsts`` (global ranks)."""

    def __init__(
        self,
        src: int,
        dsts: Sequence[int],
        *,
        backend: str | None = None,
        timeout: timedelta = timedelta(minutes=5),
        verify: bool = True,
    ):
        # (checked before the process group: int() took a rank 1.5 as 1 and True as 1, a peer that was not named)
        if not is_integer(src) or isinstance(dsts, str | bytes) or not isinstance(dsts, Sequence) or \
                not all(is_integer(d) for d in dsts):
            raise ValueError(f"src={src!r} must be an int rank and dsts={dsts!r} a list of int ranks")
        if not dist.is_initialized():
            raise RuntimeError("GuidanceSync needs torch.distributed initialised (init_process_group) first")
        world = dist.get_world_size()
        dsts = [int(d) for d in dsts]
        ranks = [int(src), *dsts]
        if not dsts or len(set(ranks)) != len(ranks):
            raise ValueError(f"need >= 1 trainer rank, all distinct from the rollout rank: src={src}, dsts={dsts}")
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ValueError(f"rank(s) {bad} do not exist in a world of {world} processes (missing peer?)")
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):  # (gloo: a store error or an abort)
            raise ValueError(f"timeout={timeout!r} must be a datetime.timedelta > 0 (how long a transfer may wait "
                             "for its peer)")
        if not isinstance(verify, bool):  # (a truthy "no" turned the checks on)
            raise ValueError(f"verify={verify!r} must be a bool (True: CRC-32 of the header and every field)")
        if backend is None:
            backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        self.src, self.dsts, self.timeout, self.verify = int(src), dsts, timeout, verify
        self.backend = backend
        self.rank = dist.get_rank()
        self.group = dist.new_group(ranks=sorted(ranks), timeout=timeout, backend=backend)
        # of the last send / receive on this rank; None after a receive that raised or a send refused before sending
        # (the previous transfer's numbers were left, logged as this one's)
        self.last_stats: TransferStats | None = None
        self._transfers: dict[int, int] = {}  # transfers started per peer (sender: per trainer rank)
        self._broken: dict[int, str] = {}  # peer -> why the link to it is unusable (see the module docstring)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    # ---- rollout side -----------------------------------------------------------------------
    def send(
        self,
        samples: Sequence[SampleGuidance],
        destination: Mapping[int, int] | Callable[[int], int] | None = None,
        *,
        routing: Sequence[SampleRouting] = (),
        chunk_bytes: int | None = None,
    ) -> dict[int, int]:
        """Send each sample (guidance and routing) to its trainer rank; returns payload bytes per destination.

        Destinations are assigned per sample id (samples first, then routing-only ids, in order).
        ``chunk_bytes``: send each rank's share in chunks of at most this many bytes (None: one).
        A rank's share that cannot be encoded ends its transfer with an abort, a broken link is skipped; the other
        ranks are served, then ``GuidanceSyncError`` names the ranks left out (bad arguments: every rank's transfer
        is aborted and the error raised as it is).
        """
        if self.rank != self.src:
            raise RuntimeError(f"send() runs on the rollout rank {self.src}, this is rank {self.rank}")
        self.last_stats = None
        try:
            if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
                                            or chunk_bytes < 1):
                raise ValueError(f"chunk_bytes={chunk_bytes!r} must be an int >= 1 or None")
            per_dst = assign_destinations(_units(samples, routing), self.dsts, destination)
        except Exception as e:  # every trainer rank waits in receive(): end its transfer with the reason
            for dst in self.dsts:
                self._abort(dst, self._next_transfer(dst), e)
            raise
        stats, sent, failed = TransferStats(samples=len(samples)), {}, {}
        for dst, units in per_dst.items():
            sent[dst] = 0
            seq = self._next_transfer(dst)
            try:
                self._check_link(dst)
                sent[dst] = self._send_transfer(units, dst, seq, chunk_bytes, stats)
            except GuidanceSyncError as e:  # a broken link (marked by _check_link / _call)
                failed[dst] = (str(e), e)
            except Exception as e:  # its share cannot be sent: the rank gets an abort and stays in step
                told = "its receive raises it" if self._abort(dst, seq, e) else "the abort failed too"
                failed[dst] = (f"transfer {seq} aborted ({told}): {type(e).__name__}: {e}", e)
        self.last_stats = stats
        if failed:
            causes = "; ".join(f"rank {d}: {why}" for d, (why, _) in failed.items())
            raise GuidanceSyncError(f"guidance for trainer rank(s) {sorted(failed)} was not delivered (rank(s) "
                                    f"{[d for d in self.dsts if d not in failed]} got theirs): {causes}"
                                    ) from next(iter(failed.values()))[1]
        logger.info("guidance sync: sent %d samples (%d with routing), %s bytes per rank, %d chunks, peak %d bytes",
                    len(samples), len(routing), sent, stats.chunks, stats.peak_bytes)
        return sent

    def _next_transfer(self, peer: int) -> int:
        seq = self._transfers.get(peer, 0)
        self._transfers[peer] = seq + 1
        return seq

    def _check_link(self, peer: int) -> None:
        if peer in self._broken:
            raise GuidanceSyncError(f"the guidance link to rank {peer} is broken ({self._broken[peer]}): recreate "
                                    "GuidanceSync on every rank (new_group is collective)")

    def _send_transfer(self, units: Sequence[_Unit], dst: int, seq: int, chunk_bytes: int | None,
                       stats: TransferStats) -> int:
        """Transfer ``seq`` to ``dst`` (its chunks, one in flight at a time); returns its payload bytes. Raises
        ``GuidanceSyncError`` only for the transport (the link is then broken), anything else for the input."""
        chunks = chunk_units(units, chunk_bytes)
        what, sent = f"sending guidance transfer {seq} to trainer rank {dst}", 0
        for i, chunk in enumerate(chunks):
            msgs, staged = self._encode_units(chunk, len(chunks) - 1 - i, self.device, seq)
            held = staged + sum(t.numel() * t.element_size() for t in msgs)
            stats.peak_bytes = max(stats.peak_bytes, held)
            n = int(msgs[0][2])
            self._send_chunk(msgs, dst, what)
            del msgs  # one chunk in flight: its buffers are freed before the next is built
            sent += n
            stats.chunks += 1
            stats.payload_bytes += n  # (as sent: also the chunks of a transfer aborted after them)
        return sent

    def _abort(self, dst: int, seq: int, cause: BaseException) -> bool:
        """End transfer ``seq`` to ``dst`` with ``cause`` as the reason; False where the link is broken."""
        if dst in self._broken:
            return False
        reason = f"{type(cause).__name__}: {cause}".encode()[:MAX_REASON]
        crc = zlib.crc32(reason) if self.verify else NO_CRC
        msgs = [torch.tensor([ABORT, len(reason), 0, 0, seq, crc], dtype=torch.int64),
                torch.frombuffer(bytearray(reason), dtype=torch.uint8)]
        try:
            self._send_chunk(msgs, dst, f"sending the abort of guidance transfer {seq} to trainer rank {dst}")
        except GuidanceSyncError as e:
            logger.warning("guidance transfer %d to rank %d: the abort could not be sent either: %s", seq, dst, e)
            return False
        return True

    def _send_chunk(self, msgs: list[torch.Tensor], dst: int, what: str) -> None:
        works = self._call(lambda: [dist.isend(t.to(self.device, non_blocking=True), dst=dst, group=self.group)
                                    for t in msgs], what, dst)
        for w in works:
            self._wait(w, what, dst)

    def encode(self, samples: Sequence[SampleGuidance], routing: Sequence[SampleRouting] = ()) -> list[torch.Tensor]:
        """The host messages of one chunk (the last): sizes, header, payload (omitted when empty)."""
        return self._encode_units(_units(samples, routing), 0, torch.device("cpu"), 0)[0]

    def _encode_units(
        self, units: Sequence[_Unit], chunks_left: int, device: torch.device, seq: int
    ) -> tuple[list[torch.Tensor], int]:
        """(messages with the payload on ``device``, bytes staged on the samples' device on the way, or 0)."""
        guidance = wire.plan_section([u.guidance for u in units if u.guidance is not None], "guidance")
        routing = wire.plan_section([u.routing for u in units if u.routing is not None], "routing")
        if guidance is not None and routing is not None and routing.head["table"] == guidance.head["table"]:
            routing.head["table"] = None  # the same samples: one table
        sections = (guidance, routing)
        n = wire.layout(sections)
        payload = host_buffer(n) if device.type == "cpu" else torch.empty(n, dtype=torch.uint8, device=device)
        wire.write(sections, payload)
        staged = max((p.nbytes for sec in sections if sec for p in sec.fields if p.device != device),
                     default=0)  # a field gathered on the samples' device before its copy
        head = {"protocol": PROTOCOL, "guidance": guidance and guidance.head, "routing": routing and routing.head}
        if self.verify:
            wire.add_field_checksums(sections, payload)
        header = json.dumps(head, separators=(",", ":")).encode()
        crc = zlib.crc32(header) if self.verify else NO_CRC
        msgs = [
            torch.tensor([MAGIC, len(header), payload.numel(), chunks_left, seq, crc], dtype=torch.int64),
            torch.frombuffer(bytearray(header), dtype=torch.uint8),
        ]
        return (msgs + [payload] if payload.numel() else msgs), staged

    # ---- trainer side -----------------------------------------------------------------------
    def receive(self) -> list[SampleGuidance]:
        """All guidance samples the rollout rank sent to this rank, after they fully arrived and validated."""
        return self.receive_shard().samples

    def receive_shard(self) -> GuidanceShard:
        """This rank's guidance and routing (all chunks), after every chunk arrived and validated. Raises
        ``GuidanceSyncError`` for a rejected or aborted transfer (the next one is in step) and for a broken link
        (every later call raises at once)."""
        if self.rank not in self.dsts:
            raise RuntimeError(f"receive() runs on trainer ranks {self.dsts}, this is rank {self.rank}")
        self.last_stats = None
        seq = self._next_transfer(self.src)
        self._check_link(self.src)
        shard, error = self._receive_transfer(seq)  # a transport failure / lost step marks the link broken
        if error is not None:  # a rejected chunk or the sender's abort: the transfer was read to its end
            raise error
        self.last_stats = shard.stats
        return shard

    def _receive_transfer(self, seq: int) -> tuple[GuidanceShard, GuidanceSyncError | None]:
        """(transfer ``seq`` read to its end, the error that rejects it or None)."""
        shard, held = GuidanceShard(), 0
        left, error = None, None
        while True:
            sizes = self._recv(torch.empty(SIZES, dtype=torch.int64, device=self.device),
                               "the size message").tolist()
            if (sizes[0] not in (MAGIC, ABORT) or sizes[1] <= 0 or sizes[2] < 0 or sizes[3] < 0
                    or (sizes[0] == ABORT and (sizes[1] > MAX_REASON or sizes[2] or sizes[3]))):
                self._lost(f"rank {self.src} sent a bad size message {sizes} (not a guidance sender?)")
            if sizes[4] != seq or (sizes[0] == MAGIC and left is not None and sizes[3] != left - 1):
                self._lost(
                    f"guidance from rank {self.src} out of step: got transfer {sizes[4]} with {sizes[3]} chunk(s) "
                    f"to come, expected transfer {seq}" + ("" if left is None else f" with {left - 1}") +
                    " (a transfer failed midway, or one side restarted: recreate GuidanceSync on both sides)")
            if sizes[0] == ABORT:  # the sender ended this transfer without (the rest of) its data
                raw = tensor_bytes(self._recv(torch.empty(sizes[1], dtype=torch.uint8, device=self.device),
                                              "the abort's reason"))
                reason = raw.decode(errors="replace")
                if sizes[5] != NO_CRC and zlib.crc32(raw) != sizes[5]:
                    reason += " (the reason arrived corrupt)"
                return GuidanceShard(), error or GuidanceSyncError(
                    f"the rollout rank {self.src} aborted guidance transfer {seq} to this rank, nothing applied: "
                    f"{reason}")
            left = sizes[3]
            header, payload = self._buffers(sizes)
            header = self._recv(header, "the header")
            if sizes[2]:
                payload = self._recv(payload, "the payload")
            if error is None:
                try:
                    guidance, routing = self._decode(header, payload, sizes[5])
                except GuidanceSyncError as e:  # read the transfer to its end: the next one starts in step
                    error, shard = e, GuidanceShard()
            if error is not None:
                if sizes[3] == 0:
                    return shard, error
                continue
            held += sizes[2]  # received samples are views into their chunk's payload
            shard.stats.peak_bytes = max(shard.stats.peak_bytes, held + sizes[1])
            if guidance is not None:
                shard.parts.append(guidance)
                shard.stats.samples += len(guidance.table)
            if routing is not None:
                shard.routing_parts.append(routing)
            shard.stats.chunks += 1
            shard.stats.payload_bytes += sizes[2]
            if sizes[3] == 0:
                return shard, None

    def _buffers(self, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Header and payload buffers, made before either is awaited: a size too large to allocate breaks the link."""
        try:
            header = torch.empty(sizes[1], dtype=torch.uint8, device=self.device)
            payload = (host_buffer(sizes[2]) if self.device.type == "cpu"
                       else torch.empty(sizes[2], dtype=torch.uint8, device=self.device))
        except (RuntimeError, MemoryError, OSError, OverflowError) as e:  # (CUDA's OOM is a RuntimeError)
            self._lost(f"rank {self.src} sent a bad size message {sizes} (not a guidance sender?): cannot "
                       f"allocate it here ({type(e).__name__})")
        return header, payload

    def _lost(self, message: str) -> None:
        """Raise: the stream from the sender is at an unknown place (its link is marked broken)."""
        self._broken[self.src] = message
        raise GuidanceSyncError(message)

    def _decode(self, header: torch.Tensor, payload: torch.Tensor, crc: int) -> tuple:
        try:
            raw = tensor_bytes(header)
            if self.verify and crc == NO_CRC:
                raise RecordFormatError("the header has no checksum: the sender runs verify=False; give both sides "
                                        "the same verify")
            if self.verify and zlib.crc32(raw) != crc:
                raise RecordFormatError(f"header checksum mismatch (corrupt or partial transfer): got "
                                        f"{zlib.crc32(raw)}, the size message says {crc}")
            head = json.loads(raw.decode())
            if not isinstance(head, dict):
                raise RecordFormatError(f"the header is a JSON {type(head).__name__}, not an object")
            if head.get("protocol") != PROTOCOL:
                raise GuidanceSyncError(
                    f"guidance protocol {head.get('protocol')!r} from the rollout rank, this trainer speaks "
                    f"{PROTOCOL}: run the same megatron_trace version on rollout and trainer ranks")
            return wire.decode(head, payload, verify=self.verify)
        except GuidanceSyncError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
            # any failure to decode rejects the chunk: the transfer is read to its end, the next one starts in step
            raise GuidanceSyncError(f"guidance from rank {self.src} rejected, nothing applied: {e}") from e

    def _recv(self, t: torch.Tensor, what: str) -> torch.Tensor:
        what = f"receiving {what} from rollout rank {self.src}"
        self._wait(self._call(lambda: dist.irecv(t, src=self.src, group=self.group), what, self.src), what,
                   self.src)
        return t

    def _wait(self, work, what: str, peer: int) -> None:
        self._call(work.wait, what, peer)

    def _call(self, fn, what: str, peer: int):
        """``fn()``; a transport error (a missing, crashed or late peer) as ``GuidanceSyncError`` naming ``what``,
        the link to ``peer`` marked broken (gloo closes it on a timeout; NCCL's watchdog aborts the group)."""
        try:
            return fn()
        except RuntimeError as e:
            self._broken[peer] = f"{what} failed: {e}"
            raise GuidanceSyncError(
                f"guidance sync failed while {what} (timeout {self.timeout}): the peer is missing, crashed or "
                f"did not call its side of the transfer: {e}"
            ) from e

    def close(self) -> None:
        dist.destroy_process_group(self.group)
