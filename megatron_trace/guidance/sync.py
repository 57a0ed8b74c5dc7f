"""Moving guidance records from a rollout rank to trainer ranks over a dedicated process group.

Like the weight-update group of RL frameworks, guidance travels on its own group (``new_group``
over the given global ranks, with its own timeout), NCCL on GPU and gloo on CPU; tensors live on
the backend's device. Per destination, three messages: a small int64 tensor ``[magic, header
bytes, payload bytes]``, the JSON header (sample metas: shapes, dtypes, versions, token hashes,
offsets, checksums) as uint8, then one flat uint8 payload with all of that rank's samples.

Destinations: each sample goes whole to the data-parallel rank that trains it (a user mapping
``sample_id -> rank``, default round-robin over ``dsts`` in send order). FC2 rows travel with
their sample too: we leave their expert-parallel routing to the Megatron dispatcher (the
trainer's MoE layer permutes FC2 guidance rows with the same token dispatch as the activations),
so no second, expert-owner exchange is needed here.

Nothing is partially applied: ``receive`` returns only after the whole payload arrived and its
lengths (and, with ``verify``, per-sample checksums) were checked; otherwise it raises
``GuidanceSyncError``. A peer that never sends makes ``receive`` fail after the group timeout
(gloo) with an error naming the rank; NCCL enforces the timeout through its watchdog.
``GuidanceSync`` must be constructed by every process of the default group (``new_group`` is
collective), with the same arguments.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .records import SampleGuidance, tensor_bytes
from .serial import RecordFormatError, add_checksums, flatten, unflatten

logger = logging.getLogger(__name__)

MAGIC = 0x54524143  # "TRAC"
PROTOCOL = 1


class GuidanceSyncError(RuntimeError):
    """A guidance transfer failed (peer missing or timed out, bad header, corrupt payload)."""


def assign_destinations(
    samples: Sequence[SampleGuidance],
    dsts: Sequence[int],
    destination: Mapping[int, int] | Callable[[int], int] | None = None,
) -> dict[int, list[SampleGuidance]]:
    """Samples per destination rank (every rank in ``dsts`` present, possibly empty)."""
    out: dict[int, list[SampleGuidance]] = {d: [] for d in dsts}
    for i, s in enumerate(samples):
        if destination is None:
            d = dsts[i % len(dsts)]
        elif isinstance(destination, Mapping):
            if s.sample_id not in destination:
                raise ValueError(f"destination mapping has no rank for sample {s.sample_id}")
            d = destination[s.sample_id]
        else:
            d = destination(s.sample_id)
        if d not in out:
            raise ValueError(f"sample {s.sample_id} mapped to rank {d}, which is not a trainer rank {list(dsts)}")
        out[d].append(s)
    return out


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
        if backend is None:
            backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        self.src, self.dsts, self.timeout, self.verify = int(src), dsts, timeout, verify
        self.backend = backend
        self.rank = dist.get_rank()
        self.group = dist.new_group(ranks=sorted(ranks), timeout=timeout, backend=backend)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    # ---- rollout side -----------------------------------------------------------------------
    def send(
        self,
        samples: Sequence[SampleGuidance],
        destination: Mapping[int, int] | Callable[[int], int] | None = None,
    ) -> dict[int, int]:
        """Send each sample to its trainer rank; returns payload bytes per destination."""
        if self.rank != self.src:
            raise RuntimeError(f"send() runs on the rollout rank {self.src}, this is rank {self.rank}")
        per_dst = assign_destinations(samples, self.dsts, destination)
        works, keep, sent = [], [], {}
        for dst, chunk in per_dst.items():
            msgs = self.encode(chunk)
            for t in msgs:
                t = t.to(self.device, non_blocking=True)
                keep.append(t)
                works.append((dst, dist.isend(t, dst=dst, group=self.group)))
            sent[dst] = int(msgs[0][2])
        for dst, w in works:
            self._wait(w, f"sending guidance to trainer rank {dst}")
        logger.info("guidance sync: sent %d samples, %s bytes per rank", len(samples), sent)
        return sent

    def encode(self, samples: Sequence[SampleGuidance]) -> list[torch.Tensor]:
        """The host messages for one destination: sizes, header, payload (omitted when empty)."""
        metas, payload = flatten(samples, device="cpu")
        if self.verify:
            add_checksums(metas, payload)
        header = json.dumps({"protocol": PROTOCOL, "samples": metas}).encode()
        msgs = [
            torch.tensor([MAGIC, len(header), payload.numel()], dtype=torch.int64),
            torch.frombuffer(bytearray(header), dtype=torch.uint8),
        ]
        return msgs + [payload] if payload.numel() else msgs

    # ---- trainer side -----------------------------------------------------------------------
    def receive(self) -> list[SampleGuidance]:
        """All samples the rollout rank sent to this rank, after they fully arrived and validated."""
        if self.rank not in self.dsts:
            raise RuntimeError(f"receive() runs on trainer ranks {self.dsts}, this is rank {self.rank}")
        sizes = self._recv(torch.empty(3, dtype=torch.int64, device=self.device), "the size message").tolist()
        if sizes[0] != MAGIC or sizes[1] <= 0 or sizes[2] < 0:
            raise GuidanceSyncError(f"rank {self.src} sent a bad size message {sizes} (not a guidance sender?)")
        header = self._recv(torch.empty(sizes[1], dtype=torch.uint8, device=self.device), "the header")
        payload = torch.empty(sizes[2], dtype=torch.uint8, device=self.device)
        if sizes[2]:
            payload = self._recv(payload, "the payload")
        try:
            head = json.loads(tensor_bytes(header).decode())
            if head.get("protocol") != PROTOCOL:
                raise GuidanceSyncError(f"guidance protocol {head.get('protocol')} != {PROTOCOL}")
            metas = head["samples"]
            need = sum(int(m["nbytes"]) for m in metas)
            if need != payload.numel():
                raise GuidanceSyncError(f"header describes {need} payload bytes, received {payload.numel()}")
            return unflatten(metas, payload, verify=self.verify)
        except (ValueError, KeyError, TypeError, RecordFormatError) as e:
            raise GuidanceSyncError(f"guidance from rank {self.src} rejected, nothing applied: {e}") from e

    def _recv(self, t: torch.Tensor, what: str) -> torch.Tensor:
        self._wait(dist.irecv(t, src=self.src, group=self.group), f"receiving {what} from rollout rank {self.src}")
        return t

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise GuidanceSyncError(
                f"guidance sync failed while {what} (timeout {self.timeout}): the peer is missing, crashed or "
                f"did not call its side of the transfer: {e}"
            ) from e

    def close(self) -> None:
        dist.destroy_process_group(self.group)
