"""Worker processes of the sync tests (module level so torch.multiprocessing spawn can import them)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trace.guidance.records import split_batch
from megatron_trace.guidance.routing import SampleRouting
from megatron_trace.guidance.sync import PROTOCOL, GuidanceSync, GuidanceSyncError
from megatron_trace.testing.megatron_cpu import free_port, spawn_ranks

from ._data import assert_samples_equal, make_batch

BACKENDS = ("gloo", "nccl")


def rollout_samples(B: int):
    """The same samples in every process (seeded), so receivers can check what arrived."""
    return rollout_batch(B)[0]


def rollout_batch(B: int):
    """(samples, {sample id: (token ids [S], attention mask [S], version)}) of two batches (nvfp4 compact,
    mxfp4 full), the same in every process."""
    out, rows = [], {}
    for part, fmt in enumerate(("nvfp4", "mxfp4")):
        batch, _, tok, mask = make_batch(B=B, seed=11 + part, fmt=fmt, compact=bool(part))
        ids = [1000 * part + i for i in range(B)]
        out += split_batch(batch, tok, version=4 + part, attention_mask=mask, sample_ids=ids)
        rows.update({sid: (tok[b], mask[b], 4 + part) for b, sid in enumerate(ids)})
    return out, rows


def run_scenario(world: int, scenario: str, tmp_path, timeout: float = 300, backend: str = "gloo") -> dict[int, str]:
    """Each rank's result line of ``scenario`` in ``world`` spawned processes (gloo on the CPU, or NCCL with one GPU
    per rank); asserts that every rank reported OK."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    port = free_port()
    codes = spawn_ranks(worker, world, lambda r: (r, world, port, scenario, str(tmp_path), backend), timeout=timeout)
    out = {}
    for r in range(world):
        f = tmp_path / f"rank{r}.txt"
        out[r] = f.read_text() if f.exists() else f"FAIL no result (exit code {codes[r]})"
    bad = {r: m for r, m in out.items() if not m.startswith("OK")}
    assert not bad, bad
    return out


def worker(rank: int, world: int, port: int, scenario: str, outdir: str, backend: str = "gloo") -> None:
    result = Path(outdir) / f"rank{rank}.txt"
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        kw = {}
        if backend == "nccl":  # one GPU per rank; the sync's buffers then live on it (GuidanceSync.device)
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60), **kw)
        for src, dsts, kw, want in [
            (0, [world], {}, "missing peer"), (-1, [1], {}, "missing peer"), (0, [], {}, "need >= 1 trainer"),
            (0, [1, 1], {}, "all distinct"), (1, [1], {}, "all distinct"),
            # (a zero timeout failed in the store, a negative one aborted in gloo, a truthy "no" turned verify on)
            (0, [1], {"timeout": timedelta(0)}, "timeout=datetime.timedelta(0) must be a datetime.timedelta > 0"),
            (0, [1], {"timeout": timedelta(seconds=-1)}, "must be a datetime.timedelta > 0"),
            (0, [1], {"timeout": 5}, "timeout=5 must be a datetime.timedelta > 0"),
            (0, [1], {"verify": "no"}, "verify='no' must be a bool")]:
            try:  # validated before the collective new_group: every rank raises, nobody hangs
                GuidanceSync(src, dsts, **kw)
                raise AssertionError(f"GuidanceSync({src}, {dsts}, {kw}) was accepted")
            except ValueError as e:
                assert want in str(e), str(e)
        short = {"missing_sender": 3, "abort_midway": 20, "dead_trainer": 20, "out_of_step": 20, "bad_sizes": 10}
        timeout = timedelta(seconds=short.get(scenario, 60))
        verify = not (scenario == "unchecked_sender" and rank == 0)
        sync = GuidanceSync(0, list(range(1, world)), timeout=timeout, verify=verify)
        try:  # each side's call on the other side's rank: refused before anything is sent or awaited
            sync.receive_shard() if rank == 0 else sync.send([])
            raise AssertionError(f"rank {rank} ran the other side's call")
        except RuntimeError as e:
            assert ("receive() runs on trainer ranks" if rank == 0 else "send() runs on the rollout rank 0") in str(e)
        samples = rollout_samples(B=5)
        if scenario == "missing_sender":
            msg = _missing_sender(rank, sync, Path(outdir))
        elif scenario in ("corrupt", "corrupt_routing", "bad_magic", "old_protocol", "unchecked_sender"):
            msg = _tampered(rank, sync, samples, scenario)
        elif scenario in ("resync", "resync_bad_header"):
            msg = _resync(rank, sync, samples, scenario)
        elif scenario == "abort_midway":
            msg = _abort_midway(rank, sync, samples)
        elif scenario == "dead_trainer":
            msg = _dead_trainer(rank, sync, samples)
        elif scenario == "empty":
            msg = _empty(rank, sync)
        elif scenario == "out_of_step":
            msg = _out_of_step(rank, sync, samples)
        elif scenario == "long_reason":
            msg = _long_reason(rank, sync, samples)
        elif scenario == "bad_sizes":
            msg = _bad_sizes(rank, world, sync)
        elif scenario == "stats_midway":
            msg = _stats_midway(rank, sync, samples)
        else:
            msg = _transfer(rank, world, sync, samples, scenario)
        result.write_text(msg)
    except Exception:  # reported to the parent test
        result.write_text("FAIL\n" + traceback.format_exc())
    finally:
        if scenario == "dead_trainer" and rank == 1:
            os._exit(0)  # a trainer that died: no clean shutdown
        if dist.is_initialized() and scenario != "missing_sender":
            dist.destroy_process_group()


def _expected(samples, world: int, scenario: str, rank: int):
    if scenario == "mapping":  # odd sample ids -> last trainer rank, even -> rank 1
        return [s for s in samples if (world - 1 if s.sample_id % 2 else 1) == rank]
    return [s for i, s in enumerate(samples) if 1 + i % (world - 1) == rank]


def _transfer(rank, world, sync, samples, scenario) -> str:
    chunk = 1500 if scenario == "chunked" else None  # ~1 sample per chunk
    if rank == 0:
        mapping = None
        if scenario == "mapping":
            mapping = {s.sample_id: (world - 1 if s.sample_id % 2 else 1) for s in samples}
        sent = sync.send(samples, mapping, chunk_bytes=chunk)
        st = sync.last_stats
        assert (st.samples, st.payload_bytes) == (len(samples), sum(sent.values())), (st, sent)
        if scenario == "chunked":  # the peak: the largest chunk's messages (one chunk in flight), as encode builds them
            from megatron_trace.guidance.sync import _units, chunk_units

            biggest = max(sum(t.nbytes for t in sync.encode([u.guidance for u in group]))
                          for dst in range(1, world) for group in chunk_units(_units(samples[dst - 1::2], ()), chunk))
            # (NCCL: + a field gathered on the samples' device (the CPU) before its copy to the GPU)
            assert st.peak_bytes == biggest if sync.device.type == "cpu" else st.peak_bytes >= biggest, (st, biggest)
        return f"OK sent {sorted(sent.items())} in {st.chunks} chunks"
    shard = sync.receive_shard()
    got = shard.samples
    want = _expected(samples, world, scenario, rank)
    assert [s.sample_id for s in got] == [s.sample_id for s in want], ([s.sample_id for s in got], rank)
    for a, b in zip(got, want):
        assert_samples_equal(a, b)
    if scenario == "chunked":
        assert shard.stats.chunks == len(shard.parts) > 1
        # every chunk's samples counted; the received samples are views of their chunks: all of them are held at once
        assert shard.stats.samples == len(want), (shard.stats.samples, len(want))
        assert shard.stats.peak_bytes > shard.stats.payload_bytes, shard.stats  # and a header
        assert sync.last_stats is shard.stats
        _check_assembly(shard, want)
        st = shard.stats
        return f"OK received {[s.sample_id for s in got]} in {st.payload_bytes} bytes, {st.chunks} chunks"
    return f"OK received {[s.sample_id for s in got]}"


def _check_assembly(shard, want) -> None:
    """The trainer's batch from the received columns (several chunks) == ``records.assemble`` of the samples."""
    from megatron_trace.guidance.records import assemble, payload_of
    from megatron_trace.guidance.site import FallbackCounter

    rows = rollout_batch(5)[1]
    ids = [s.sample_id for s in want][::-1] + [None]  # rows in another order, and a row without a sample
    tok = torch.stack([rows[i][0] if i is not None else rows[want[0].sample_id][0] for i in ids])
    mask = torch.stack([rows[i][1] if i is not None else rows[want[0].sample_id][1] for i in ids])
    versions = [rows[i][2] if i is not None else 0 for i in ids]
    by_id = {s.sample_id: s for s in want}
    c1, c2 = FallbackCounter(), FallbackCounter()
    o1 = assemble([by_id.get(i) for i in ids], tok, versions=versions, counter=c1, attention_mask=mask)
    o2 = shard.assemble(ids, tok, versions=versions, counter=c2, attention_mask=mask)
    assert list(o1) == list(o2) and (c1.used, c1.fallback) == (c2.used, c2.fallback), (c1, c2)
    assert c1.fallback["shape"] > 0 and c1.fallback["missing"] > 0  # mixed formats; the empty row
    for k in o1:
        assert torch.equal(payload_of(o1[k].record), payload_of(o2[k].record)) and torch.equal(o1[k].valid, o2[k].valid)


def _missing_sender(rank, sync, outdir: Path) -> str:
    """The rollout rank stays alive but never sends (until the trainer gave up, at most 40 s): the trainer's receive
    fails after the group's own timeout (3 s), not the default group's (60 s) or when the sender exits."""
    done, gloo = outdir / "receiver_done", sync.backend == "gloo"  # NCCL: its watchdog enforces the timeout
    if rank == 0:
        t0 = time.monotonic()
        while not done.exists() and time.monotonic() - t0 < (40 if gloo else 5):
            time.sleep(0.1)
        return "OK idle"
    t0 = time.monotonic()
    try:
        sync.receive()
    except GuidanceSyncError as e:
        secs = time.monotonic() - t0
        assert "rollout rank 0" in str(e) and "missing" in str(e) and "timeout 0:00:03" in str(e), str(e)
        assert secs < 20 or not gloo, f"the receive failed after {secs:.1f}s, not the group's timeout of 3 s"
        return f"OK timed out after {secs:.1f}s"
    finally:
        done.touch()
    return "FAIL receive returned without a sender"


def _tampered(rank, sync, samples, scenario) -> str:
    """The sender corrupts one payload byte (after checksums) or the size message: nothing applied."""
    if rank == 0:
        routing = [SampleRouting(s.sample_id, s.version, s.token_hash, s.num_tokens,
                                 {0: torch.arange(2 * s.num_tokens, dtype=torch.int16).view(-1, 2)}) for s in samples]
        msgs = sync.encode(samples, routing if scenario == "corrupt_routing" else ())
        if scenario == "corrupt":
            msgs[2][len(msgs[2]) // 2] ^= 0x10
        elif scenario == "corrupt_routing":  # the last routing byte
            msgs[2][-1] ^= 0x01
        elif scenario == "unchecked_sender":  # a sender with verify=False: no checksums to check the byte
            msgs[2][len(msgs[2]) // 2] ^= 0x10
        elif scenario == "old_protocol":  # a sender of wire format 2 (blake2b checksums)
            head = json.loads(bytes(msgs[1].tolist()))
            head["protocol"] = 2
            raw = json.dumps(head).encode()
            msgs[0][1], msgs[0][5] = len(raw), zlib.crc32(raw)
            msgs[1] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        else:
            msgs[0][0] = 12345
            msgs = msgs[:1]
        for t in msgs:
            dist.send(t.to(sync.device), dst=1, group=sync.group)
        return "OK sent tampered"
    try:
        got = sync.receive()
    except GuidanceSyncError as e:
        want = {"corrupt": "checksum", "corrupt_routing": "routing checksum mismatch",
                "unchecked_sender": "the header has no checksum: the sender runs verify=False",
                "old_protocol": f"protocol 2 from the rollout rank, this trainer speaks {PROTOCOL}"}.get(
                    scenario, "bad size")
        assert want in str(e), str(e)
        return f"OK rejected: {want}"
    return f"FAIL accepted {len(got)} tampered samples"


def _resync(rank, sync, samples, scenario="resync") -> str:
    """Transfer 0 in 3 chunks whose first is corrupt (a payload byte, or a header naming a negative dimension that
    its sender wrote: checksum intact), then transfer 1: the receiver rejects transfer 0 whole (reading it to its
    end) and gets transfer 1's samples, not transfer 0's leftover chunks. A corrupt chunk followed by the sender's
    abort is rejected for the corruption (the first error), and the next transfer is in step."""
    from megatron_trace.guidance.sync import _units, chunk_units

    first, second = samples[:3], samples[3:]
    if rank == 0:
        chunks = chunk_units(_units(first, ()), 1)  # one sample per chunk
        seq = sync._transfers.get(1, 0)
        sync._transfers[1] = seq + 1
        for i, chunk in enumerate(chunks):
            msgs, _ = sync._encode_units(chunk, len(chunks) - 1 - i, sync.device, seq)
            if i == 0 and scenario == "resync":
                msgs[2][0] ^= 0x10  # the first field's first byte
            elif i == 0:
                head = json.loads(bytes(msgs[1].tolist()))
                head["guidance"]["columns"][0]["fields"][0][2][1] *= -1
                raw = json.dumps(head).encode()
                msgs[0][1], msgs[0][5] = len(raw), zlib.crc32(raw)
                msgs[1] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            for t in msgs:
                dist.send(t.to(sync.device), dst=1, group=sync.group)
        sync.send(second, chunk_bytes=1)
        if scenario == "resync":  # transfer 2: a corrupt chunk, then the sender's abort; transfer 3: good
            seq = sync._next_transfer(1)
            msgs, _ = sync._encode_units(chunks[0], 1, sync.device, seq)
            msgs[2][0] ^= 0x10
            sync._send_chunk(msgs, 1, "a corrupt chunk")
            assert sync._abort(1, seq, MemoryError("emulated"))
            sync.send(second)
        return "OK sent"
    try:
        sync.receive()
        return "FAIL the corrupt transfer was accepted"
    except GuidanceSyncError as e:
        want = "checksum" if scenario == "resync" else "nothing applied: column [0, 'expert_fc1_in'] field payload"
        assert want in str(e) and (scenario == "resync" or "has a negative dimension" in str(e)), str(e)
    got = sync.receive()
    assert [s.sample_id for s in got] == [s.sample_id for s in second], [s.sample_id for s in got]
    for a, b in zip(got, second):
        assert_samples_equal(a, b)
    if scenario == "resync":  # the transfer's first error is the one raised: the rejection, not the later abort
        try:
            sync.receive()
            return "FAIL the corrupt, then aborted transfer was accepted"
        except GuidanceSyncError as e:
            assert "checksum" in str(e) and "aborted" not in str(e), str(e)
        assert [s.sample_id for s in sync.receive()] == [s.sample_id for s in second]
    return f"OK resynced {[s.sample_id for s in got]}"


def _unencodable(s):
    """``s`` with one site's record lost (None): the rollout rank cannot encode it."""
    key = next(iter(s.sites))
    return dataclasses.replace(s, sites={**s.sites, key: None}, source=None)


def _receive_all(sync, rounds: int) -> list[str]:
    """Each receive's outcome ("ok [ids]" or the error) and how long it took."""
    out = []
    for _ in range(rounds):
        t0 = time.monotonic()
        try:
            got = sync.receive()
            what = f"ok {[s.sample_id for s in got]}"
        except GuidanceSyncError as e:
            what = f"error {e}"
        out.append((what, time.monotonic() - t0))
    return out


def _abort_midway(rank, sync, samples) -> str:
    """Send 0 fails at rank 1 (a sample it cannot encode), send 2 before any rank (a bad mapping), send 4 midway
    through every rank's transfer (as an out-of-memory building its second chunk would): every trainer rank's receive
    ends at once (an abort naming the reason, or its data), and sends 1, 3 and 5 arrive whole on both ranks."""
    from megatron_trace.guidance.sync import _units, chunk_units

    good = samples[:6]  # rank 1: ids 0, 2, 4; rank 2: ids 1, 3, 1000
    if rank == 0:
        bad = [_unencodable(s) if s.sample_id == 2 else s for s in good]
        out = []
        for attempt, (batch, mapping) in enumerate([(bad, None), (good, None), (good, lambda sid: 7), (good, None),
                                                    (None, None), (good, None)]):
            if batch is None:  # chunk 0 of each rank's transfer, then its abort
                for dst in (1, 2):
                    seq, first = sync._next_transfer(dst), chunk_units(_units(good[dst - 1::2], ()), 1)[0]
                    sync._send_chunk(sync._encode_units(first, 2, sync.device, seq)[0], dst, "chunk 0")
                    assert sync._abort(dst, seq, MemoryError("emulated: no memory for chunk 1"))
                out.append("aborted midway")
                continue
            try:
                sync.send(batch, mapping, chunk_bytes=1)  # one sample per chunk
                out.append("sent")
            except GuidanceSyncError as e:
                assert attempt == 0 and "trainer rank(s) [1] was not delivered (rank(s) [2] got theirs)" in str(e) \
                    and "transfer 0 aborted (its receive raises it)" in str(e), str(e)
                assert "is not a SiteRecord" in str(e), str(e)
                out.append("failed for rank 1")
            except ValueError as e:
                assert attempt == 2 and "not a trainer rank" in str(e), str(e)
                out.append("refused")
        assert out == ["failed for rank 1", "sent", "refused", "sent", "aborted midway", "sent"], out
        assert sync._transfers == {1: 6, 2: 6}, sync._transfers
        return "OK " + ", ".join(out)
    got = _receive_all(sync, 6)
    ok = f"ok {[s.sample_id for i, s in enumerate(good) if 1 + i % 2 == rank]}"
    expect = [("aborted guidance transfer 0" if rank == 1 else ok), ok, "aborted guidance transfer 2", ok,
              "aborted guidance transfer 4", ok]
    for (what, secs), exp in zip(got, expect):
        assert exp in what, (what, exp)
        assert secs < 10, f"{what!r} took {secs:.1f}s: the receiver waited for the timeout"
    assert rank == 2 or "ValueError: sample 2 site (0, 'expert_fc1_in'): NoneType is not a SiteRecord" in got[0][0], \
        got[0]
    assert "not a trainer rank" in got[2][0] and "MemoryError: emulated" in got[4][0], got
    return "OK " + " | ".join(w for w, _ in got)


def _dead_trainer(rank, sync, samples) -> str:
    """Trainer rank 1 dies before its receive: rank 2 still gets every send; the sender names rank 1 each time, the
    second time at once (its link is marked broken: recreate GuidanceSync)."""
    good = samples[:4]
    if rank == 1:
        return "OK died"  # the worker exits without a shutdown
    if rank == 0:
        time.sleep(2)  # rank 1 is gone
        out = []
        for _ in range(2):
            t0 = time.monotonic()
            try:
                sync.send(good)
                out.append("sent")
            except GuidanceSyncError as e:
                assert "trainer rank(s) [1] was not delivered (rank(s) [2] got theirs)" in str(e), str(e)
                assert "aborted" not in str(e), str(e)  # a transport failure: no abort is sent on a broken link
                out.append(f"failed for rank 1 in {time.monotonic() - t0:.0f}s"
                           + (" (broken link)" if "recreate GuidanceSync" in str(e) else ""))
        assert out[0].startswith("failed for rank 1") and out[1] == "failed for rank 1 in 0s (broken link)", out
        return "OK " + ", ".join(out)
    got = _receive_all(sync, 2)
    want = f"ok {[s.sample_id for i, s in enumerate(good) if i % 2]}"
    assert [w for w, _ in got] == [want, want], got
    return "OK " + " | ".join(w for w, _ in got)


def _out_of_step(rank, sync, samples) -> str:
    """A chunk lost from the middle of a transfer (rank 1: chunks 0 and 2 of 3 arrive) and a transfer of another
    number (rank 2: transfer 1 where 0 was due) are refused, not taken for a whole transfer; the link is then broken:
    the next receive raises at once, saying to recreate GuidanceSync."""
    from megatron_trace.guidance.sync import _units, chunk_units

    if rank == 0:
        chunks = chunk_units(_units(samples[:3], ()), 1)  # one sample per chunk
        assert len(chunks) == 3
        msgs = [sync._encode_units(c, 2 - i, sync.device, 0)[0] for i, c in enumerate(chunks)]
        sync._send_chunk(msgs[0], 1, "chunk 0")
        dist.send(msgs[2][0].to(sync.device), dst=1, group=sync.group)  # chunk 2's size message: chunk 1 lost
        dist.send(sync._encode_units(chunks[0], 0, sync.device, 1)[0][0].to(sync.device), dst=2, group=sync.group)
        return "OK sent out of step"
    out = []
    for _ in range(2):
        t0 = time.monotonic()
        try:
            got = sync.receive()
            return f"FAIL receive returned {[s.sample_id for s in got]}"
        except GuidanceSyncError as e:
            out.append((str(e), time.monotonic() - t0))
    (first, _), (second, secs) = out
    want = "with 0 chunk(s) to come, expected transfer 0 with 1" if rank == 1 else "got transfer 1 with 0 chunk(s) " \
        "to come, expected transfer 0"
    assert "out of step" in first and want in first, first
    assert "is broken" in second and "recreate GuidanceSync" in second and secs < 5, (second, secs)
    return "OK refused, then broken"


def _bad_sizes(rank, world, sync) -> str:
    """Size messages no guidance sender writes (a header of no bytes, a negative payload or chunk count, an abort
    with a payload, chunks to come, no reason or a reason longer than ``MAX_REASON``, a header or payload larger
    than any machine's memory) are refused at once as a bad size message, nothing else awaited; each breaks the
    link, so each goes over a new ``GuidanceSync``. (The unallocatable ones escaped as a MemoryError / RuntimeError
    that left the link looking whole.)"""
    from megatron_trace.guidance.sync import ABORT, MAGIC, MAX_REASON

    bad = [[MAGIC, 0, 0, 0, 0, 0], [MAGIC, 5, -1, 0, 0, 0], [MAGIC, 5, 0, -1, 0, 0], [ABORT, 5, 3, 0, 0, 0],
           [ABORT, 5, 0, 2, 0, 0], [ABORT, 0, 0, 0, 0, 0], [ABORT, MAX_REASON + 1, 0, 0, 0, 0],
           [MAGIC, 2**62, 0, 0, 0, 0], [MAGIC, 5, 2**62, 0, 0, 0]]
    out = []
    for sizes in bad:
        if rank == 0:
            dist.send(torch.tensor(sizes, dtype=torch.int64), dst=1, group=sync.group)
        else:
            t0 = time.monotonic()
            try:
                sync.receive()
                return f"FAIL {sizes} was accepted"
            except GuidanceSyncError as e:
                assert f"sent a bad size message {sizes}" in str(e) and time.monotonic() - t0 < 5, (str(e), sizes)
            out.append("refused")
        sync = GuidanceSync(0, list(range(1, world)), timeout=sync.timeout)  # collective: on every rank
    return f"OK {out}"


def _stats_midway(rank, sync, samples) -> str:
    """A send that fails at its third chunk (a sample whose routing ids were made float after construction): the
    sender's ``last_stats`` count the two chunks that went out and their payload bytes (as ``encode`` builds those
    chunks), not 2 chunks of 0 bytes; the next send's bytes are the same on both sides; after a send refused before
    sending, and a receive that raised, ``last_stats`` is None (it held the previous transfer's)."""
    def routing():
        return [SampleRouting(s.sample_id, s.version, s.token_hash, s.num_tokens,
                              {0: torch.arange(2 * s.num_tokens, dtype=torch.int16).view(-1, 2)}) for s in samples]

    if rank == 0:
        bad, routing = routing(), routing()
        bad[2].experts[0] = bad[2].experts[0].float()  # (a mutable dict: checked where it is sent)
        try:
            sync.send(samples, routing=bad, chunk_bytes=1)  # one sample per chunk
            return "FAIL the send with float routing ids went through"
        except GuidanceSyncError as e:
            assert "transfer 0 aborted" in str(e) and "field experts is torch.float32" in str(e), str(e)
        want = sum(sync.encode([s], [r])[2].numel() for s, r in zip(samples[:2], routing))
        got = sync.last_stats
        assert (got.chunks, got.payload_bytes) == (2, want), (got, want)
        sent = sync.send(samples, routing=routing, chunk_bytes=1)
        assert sync.last_stats.payload_bytes == sent[1], (sync.last_stats, sent)
        try:  # refused before sending: no stats, not the previous send's
            sync.send(samples, routing=routing, chunk_bytes=0)
            return "FAIL chunk_bytes=0 was sent"
        except ValueError:
            assert sync.last_stats is None, sync.last_stats
        return f"OK {got.payload_bytes} bytes in 2 chunks, then {sent[1]}"
    try:
        sync.receive()
        return "FAIL the aborted transfer was received"
    except GuidanceSyncError as e:
        assert "aborted guidance transfer 0" in str(e), str(e)
    sync.receive()
    received = sync.last_stats.payload_bytes
    try:  # a receive that raised: no stats, not the previous transfer's
        sync.receive()
        return "FAIL the refused transfer was received"
    except GuidanceSyncError:
        assert sync.last_stats is None, sync.last_stats
    return f"OK aborted, then {received}"


def _long_reason(rank, sync, samples) -> str:
    """A send refused for a reason longer than an abort carries (``MAX_REASON`` bytes, cut inside a character): the
    trainer gets the reason's start in its error, and the next transfer arrives in step (the abort is not taken for
    a bad message). Then sends refused for their ``chunk_bytes`` (0: the abort as it is on the wire; True), an abort
    whose reason arrived corrupt (said so in the error) and one from a sender without checksums, and a good send."""
    from megatron_trace.guidance.sync import ABORT, MAX_REASON, NO_CRC

    reason = "no rank for this sample: xx" + "é" * MAX_REASON  # 2 bytes each: the cut falls inside one
    told = b"GuidanceSyncError: told by hand"

    def destination(sid):
        raise ValueError(reason)

    if rank == 0:
        try:
            sync.send(samples, destination)
            return "FAIL the send was not refused"
        except ValueError as e:
            assert str(e) == reason
        for bad in (0, True):
            try:
                sync.send(samples[:2], chunk_bytes=bad)
                return f"FAIL chunk_bytes={bad!r} was accepted"
            except ValueError as e:
                assert f"chunk_bytes={bad!r} must be an int >= 1 or None" in str(e), str(e)
        for crc in (zlib.crc32(told) ^ 1, NO_CRC):
            sizes = torch.tensor([ABORT, len(told), 0, 0, sync._next_transfer(1), crc], dtype=torch.int64)
            sync._send_chunk([sizes, torch.frombuffer(bytearray(told), dtype=torch.uint8)], 1, "an abort by hand")
        sync.send(samples[:2])
        return "OK refused, then sent"
    errors = []
    for n in range(5):
        if n == 1:  # the abort as it travels: size message [ABORT, reason bytes, 0, 0, transfer, CRC], the reason
            sizes = torch.empty(6, dtype=torch.int64, device=sync.device)
            dist.recv(sizes, src=0, group=sync.group)
            raw = torch.empty(int(sizes[1]), dtype=torch.uint8, device=sync.device)
            dist.recv(raw, src=0, group=sync.group)
            raw = bytes(raw.tolist())
            assert raw == b"ValueError: chunk_bytes=0 must be an int >= 1 or None", raw
            assert sizes.tolist() == [ABORT, len(raw), 0, 0, 1, zlib.crc32(raw)], sizes.tolist()
            sync._transfers[0] += 1  # read by hand: the next receive is transfer 2
            continue
        try:
            sync.receive()
            return f"FAIL the aborted transfer {n} returned"
        except GuidanceSyncError as e:
            errors.append(str(e))
    msg = errors[0]
    assert "aborted guidance transfer 0" in msg and "ValueError: no rank for this sample: xxéé" in msg, msg[:300]
    assert len(msg.encode()) < MAX_REASON + 200 and msg.endswith("é\ufffd"), (len(msg), msg[-20:])  # cut, shown
    assert "aborted guidance transfer 2" in errors[1] and "chunk_bytes=True must be" in errors[1], errors[1]
    assert errors[2].endswith("told by hand (the reason arrived corrupt)"), errors[2]
    assert errors[3].endswith("told by hand"), errors[3]  # no checksum: nothing to tell
    assert not any("corrupt" in e for e in errors[:2]), errors
    got = sync.receive()
    assert [s.sample_id for s in got] == [s.sample_id for s in samples[:2]], [s.sample_id for s in got]
    return "OK aborted, then received"


def _empty(rank, sync) -> str:
    """Transfers with nothing in them: a trainer rank without samples; samples without records (no payload message);
    a guided layer with no records at all (absent from the rollout batch) and samples of 0 tokens, in chunks. What
    arrives is exactly what was sent, and the trainer's assembly counts every guided row without a record."""
    from megatron_trace.guidance.records import SampleGuidance
    from megatron_trace.guidance.site import FallbackCounter

    from ._data import make_batch

    batch, _, tok, mask = make_batch(B=4, S=6, lengths=[6, 0, 5, 0], layers=(0, 1),
                                     sites=("expert_fc1_in", "expert_fc2_in"))
    ids = [10, 11, 12, 13]
    full = split_batch(batch, tok, version=1, attention_mask=mask, sample_ids=ids)
    no_records = [SampleGuidance(s.sample_id, s.version, s.token_hash, s.num_tokens, {}) for s in full]
    layer0 = split_batch({k: v for k, v in batch.items() if k[0] == 0}, tok, version=1, attention_mask=mask,
                         sample_ids=ids)  # the rollout recorded nothing at layer 1
    keys = sorted(batch)  # the trainer's guided sites
    rounds = [(full, {i: 1 for i in ids}, None), (no_records, None, None), (layer0, {10: 1, 11: 2, 12: 1, 13: 2}, 1)]
    if rank == 0:
        out = []
        for samples, mapping, chunk in rounds:
            sent = sync.send(samples, mapping, chunk_bytes=chunk)
            out.append((sent, sync.last_stats.chunks))
        assert out[0][0][2] == 0 and out[1][0] == {1: 0, 2: 0} and out[2][0][2] == 0, out  # no payload bytes
        return f"OK {out}"
    log = []
    for n, (samples, mapping, _) in enumerate(rounds):
        shard = sync.receive_shard()
        mine = [s for i, s in enumerate(samples) if (mapping or {}).get(s.sample_id, 1 + i % 2) == rank]
        assert [s.sample_id for s in shard.samples] == [s.sample_id for s in mine], (n, shard.samples)
        for a, b in zip(shard.samples, mine):
            assert_samples_equal(a, b)
        counts = []
        for k in (keys, None):
            rows = [ids.index(s.sample_id) for s in mine]
            c = FallbackCounter()
            out = shard.assemble([s.sample_id for s in mine], tok[rows], versions=1, counter=c,
                                 attention_mask=mask[rows], keys=k, topk=3 if k else None) if mine else {}
            counts.append((c.used, dict(c.fallback), sorted(out)))
        log.append((n, shard.stats.payload_bytes, counts))
    T = 11  # tokens of samples 10 and 12 (rank 1's)
    rows = T * (1 + 3)  # guided rows of one layer: FC1 one per token, FC2 one per (token, top-3 expert)
    if rank == 1:
        l0 = [(0, "expert_fc1_in"), (0, "expert_fc2_in")]
        assert log[0][2] == [(2 * rows, {}, keys)] * 2, log[0]
        # a guided key no sample has is counted per row the trainer's layer quantizes (FC2: top-k per token);
        # without keys (the sites unknown) once per token
        assert log[1][1] == 0 and log[1][2] == [(0, {"missing": 2 * rows}, []), (0, {"missing": T}, [])], log[1]
        assert log[2][2] == [(rows, {"missing": rows}, l0), (rows, {}, l0)], log[2]
    else:  # nothing in round 0; samples of 0 tokens in rounds 1 and 2
        assert log[0][1] == 0 and log[0][2] == [(0, {}, [])] * 2, log[0]
        assert all(entry[1] == 0 and entry[2][0][:2] == (0, {}) for entry in log[1:]), log
    return f"OK {log}"
