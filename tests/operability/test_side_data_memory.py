"""Issue 11 item 9: guidance and routing side data (64k tokens) are sharded per trainer rank, sent in chunks,
and the transfer's peak memory per rank is bounded by that rank's shard (receiver) or one chunk (sender)."""

import json

import pytest

from megatron_trace.testing.megatron_cpu import free_port, spawn_ranks

from ._memory_worker import CHUNK, worker

WORLD = 3  # one rollout rank, two trainer ranks
SLACK = 64 << 10  # headers (JSON sample tables) and 16-byte alignment


def violations(res: dict[int, dict], scenario: str) -> list[str]:
    """The memory bounds of a transfer: what fails when side data is broadcast, concentrated or sent at once."""
    total, out = res[1]["total_bytes"], []
    send = res[0][scenario]
    if send["guidance_sync/peak_bytes"] > 1.05 * max(CHUNK, res[0]["max_sample_bytes"]) + SLACK:
        out.append(f"sender peak {send['guidance_sync/peak_bytes']:.0f} > one chunk ({CHUNK})")
    for r in range(1, WORLD):
        shard, st = res[r][f"{scenario}/shard_bytes"], res[r][scenario]
        if st["guidance_sync/peak_bytes"] > 1.05 * shard + SLACK:
            out.append(f"rank {r} peak {st['guidance_sync/peak_bytes']:.0f} > its shard {shard}")
        if shard > 0.55 * total:
            out.append(f"rank {r} holds {shard} of {total} bytes: more than its share")
    return out


@pytest.fixture(scope="module")
def transfers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory")
    port = free_port()
    codes = spawn_ranks(worker, WORLD, lambda r: (r, WORLD, port, str(tmp)), timeout=180)
    out = {}
    for r in range(WORLD):
        f = tmp / f"rank{r}.json"
        text = f.read_text() if f.exists() else f"FAIL no result (exit code {codes[r]})"
        assert text.startswith("OK"), text
        out[r] = json.loads(text[2:])
    return out


def test_64k_tokens_sharded_incrementally_within_bounds(transfers):
    res = transfers
    assert res[0]["tokens"] >= 64_000 and res[0]["total_bytes"] > 12 * CHUNK
    assert not violations(res, "chunked")
    send = res[0]["chunked"]
    assert send["guidance_sync/chunks"] >= 12  # incremental: many messages, each <= one chunk
    assert sum(res[r]["chunked"]["guidance_sync/payload_bytes"] for r in (1, 2)) == send["guidance_sync/payload_bytes"]
    assert res[1]["chunked"]["guidance_sync/chunks"] > 1


def test_the_bounds_fire_on_one_shot_and_concentrated_transfers(transfers):
    one_shot = violations(transfers, "one_shot")
    assert one_shot and all(v.startswith("sender peak") for v in one_shot)
    assert any("more than its share" in v for v in violations(transfers, "concentrated"))
