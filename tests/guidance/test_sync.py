import ast
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_trace.guidance.records import split_batch
from megatron_trace.guidance.routing import SampleRouting, split_routing
from megatron_trace.guidance.sync import GuidanceSync, _units, assign_destinations, chunk_units

from ._data import make_batch
from ._dist import rollout_samples
from ._dist import run_scenario as _run


def test_one_rollout_one_trainer_records_identical(tmp_path):
    out = _run(2, "round_robin", tmp_path)
    assert out[1] == f"OK received {[s.sample_id for s in rollout_samples(5)]}"


def test_two_trainers_get_the_round_robin_split(tmp_path):
    out = _run(3, "round_robin", tmp_path)
    ids = [s.sample_id for s in rollout_samples(5)]
    assert out[1] == f"OK received {ids[0::2]}" and out[2] == f"OK received {ids[1::2]}"


def test_two_trainers_with_a_user_mapping(tmp_path):
    out = _run(3, "mapping", tmp_path)
    ids = [s.sample_id for s in rollout_samples(5)]
    assert out[1] == f"OK received {[i for i in ids if i % 2 == 0]}"
    assert out[2] == f"OK received {[i for i in ids if i % 2 == 1]}"


def test_two_trainers_chunked_columns_assemble_like_samples(tmp_path):
    """Chunks of ~1 sample: every chunk arrives as its own columns; the trainer's batch assembled from them
    equals ``records.assemble`` of the samples (rows reordered, a missing row, mixed formats: shape fallback)."""
    out = _run(3, "chunked", tmp_path)
    ids = [s.sample_id for s in rollout_samples(5)]
    sent, chunks = out[0].removeprefix("OK sent ").removesuffix(" chunks").split(" in ")
    sent = dict(ast.literal_eval(sent))  # payload bytes per rank, as the sender counted
    assert out[1].startswith(f"OK received {ids[0::2]} in {sent[1]} bytes, ")
    assert out[2].startswith(f"OK received {ids[1::2]} in {sent[2]} bytes, ")
    assert sum(int(out[r].split(", ")[-1].removesuffix(" chunks")) for r in (1, 2)) == int(chunks)  # as counted


def test_missing_sender_times_out_with_a_clear_error(tmp_path):
    out = _run(2, "missing_sender", tmp_path)
    assert out[1].startswith("OK timed out")


@pytest.mark.parametrize("scenario", ["corrupt", "corrupt_routing", "bad_magic", "old_protocol", "unchecked_sender"])
def test_tampered_transfer_is_rejected_whole(tmp_path, scenario):
    out = _run(2, scenario, tmp_path)
    assert out[1].startswith("OK rejected")


@pytest.mark.parametrize("scenario", ["resync", "resync_bad_header"])
def test_a_rejected_transfer_leaves_the_next_one_in_step(tmp_path, scenario):
    out = _run(2, scenario, tmp_path)
    assert out[1] == f"OK resynced {[s.sample_id for s in rollout_samples(5)[3:]]}"


def test_a_send_that_fails_midway_or_before_any_rank_keeps_every_rank_in_step(tmp_path):
    """A rank's share that cannot be sent ends its transfer with an abort, also after some of its chunks (its receive
    raises the reason at once, no timeout); the other rank gets its data; the next sends arrive whole on both."""
    out = _run(3, "abort_midway", tmp_path)
    assert out[0] == "OK failed for rank 1, sent, refused, sent, aborted midway, sent"


def test_a_size_message_no_sender_writes_is_refused_at_once(tmp_path):
    out = _run(2, "bad_sizes", tmp_path)
    assert out[1] == f"OK {['refused'] * 9}"


def test_a_lost_chunk_or_a_transfer_out_of_step_is_refused_and_breaks_the_link(tmp_path):
    out = _run(3, "out_of_step", tmp_path)
    assert out[1] == out[2] == "OK refused, then broken"


def test_a_send_that_fails_midway_reports_the_bytes_it_sent(tmp_path):
    out = _run(2, "stats_midway", tmp_path)
    assert out[0].split(", then ")[1] == out[1].split(", then ")[1]  # the next send: as many bytes on both sides


def test_an_abort_with_a_long_reason_keeps_the_ranks_in_step(tmp_path):
    out = _run(2, "long_reason", tmp_path)
    assert out[0] == "OK refused, then sent" and out[1] == "OK aborted, then received"


def test_a_dead_trainer_rank_does_not_starve_the_others(tmp_path):
    out = _run(3, "dead_trainer", tmp_path)
    assert out[2].count("ok") == 2


def test_empty_transfers_arrive_as_sent_and_missing_records_are_counted(tmp_path):
    """A rank without samples, samples without records (no payload), a guided layer without any record and samples
    of 0 tokens: nothing crashes or is dropped, and the trainer's assembly counts the guided rows without records
    as ``missing`` (a layer no sample has: counted by the trainer's layer, as records.assemble leaves it out)."""
    out = _run(3, "empty", tmp_path)
    assert out[0].startswith("OK")


def test_assign_destinations_validates():
    samples = rollout_samples(2)
    per = assign_destinations(samples, [1, 2, 3])
    assert [len(v) for v in per.values()] == [2, 1, 1]
    with pytest.raises(ValueError, match="not a trainer rank"):
        assign_destinations(samples, [1, 2], lambda sid: 7)
    with pytest.raises(ValueError, match="no rank for sample"):
        assign_destinations(samples, [1], {})


def test_a_sample_sent_twice_is_refused_not_dropped():
    """Guidance or routing of one sample id twice in one send: refused naming the id (one of them would otherwise
    replace the other, and a sample's rows silently go missing)."""
    samples = rollout_samples(2)
    routing = [SampleRouting(s.sample_id, s.version, s.token_hash, s.num_tokens, {}) for s in samples]
    assert [u.sample_id for u in _units(samples, routing)] == [s.sample_id for s in samples]
    later = [s for s in rollout_samples(3)[::-1] if s.sample_id != samples[1].sample_id]  # not sorted
    # units in send order: the guidance's, then the routing-only ids
    assert [u.sample_id for u in _units(later, routing[::-1])] == [s.sample_id for s in later] + [samples[1].sample_id]
    sid = samples[1].sample_id
    with pytest.raises(ValueError, match=f"sample {sid} appears twice in the guidance to send"):
        _units([*samples, samples[1]], ())
    with pytest.raises(ValueError, match=f"sample {sid} appears twice in the routing to send"):
        _units(samples, [*routing, routing[1]])


def test_needs_initialised_distributed():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        GuidanceSync(0, [1], timeout=timedelta(seconds=1))


def _split(lengths=(9, 7, 0, 5, 8)):
    """Guidance and routing of one batch (samples of different sizes, one of 0 tokens): views of their columns."""
    B = len(lengths)
    batch, _, tok, mask = make_batch(B=B, lengths=list(lengths))
    ids = [20 + b for b in range(B)]
    g = torch.Generator().manual_seed(3)
    routing = split_routing({0: torch.randint(0, 8, (B, tok.shape[1], 3), generator=g)}, tok, version=1,
                            num_experts=8, attention_mask=mask, sample_ids=ids)
    return split_batch(batch, tok, version=1, attention_mask=mask, sample_ids=ids), routing


def test_a_units_bytes_are_its_guidance_and_routing_also_for_a_subset_of_columns():
    """Chunking reads a view's bytes from its columns: the bytes of *that* sample (not the column's first), routing
    included, as the sample's own tensors count them."""
    samples, routing = _split()
    for part in (slice(None), slice(1, None, 2), slice(3, None)):  # a rank's share: a subset of the columns
        units = _units(samples[part], routing[part])
        assert [u.nbytes() for u in units] == [s.nbytes() + r.nbytes() for s, r in zip(samples[part], routing[part])]
    assert len({s.nbytes() for s in samples}) == len(samples)  # all different: a wrong index is seen


def test_chunks_are_consecutive_greedy_groups_of_at_most_chunk_bytes():
    """Groups in send order, none empty, each within ``chunk_bytes`` unless it is one sample larger than it, and
    each as full as it can be (the next group's first sample would not have fit), for limits at and beside every
    boundary; an empty send is one empty group (its transfer still ends)."""
    samples, routing = _split()
    units = _units(samples, routing)
    sizes = {u.sample_id: s.nbytes() + r.nbytes() for u, s, r in zip(units, samples, routing)}
    ends = [sum(list(sizes.values())[: i + 1]) for i in range(len(units))]
    for limit in sorted({1, *ends, *(e - 1 for e in ends), *(e + 1 for e in ends), 10**12} - {0}):
        groups = chunk_units(units, limit)
        assert [u for g in groups for u in g] == units and all(groups), limit
        size = [sum(sizes[u.sample_id] for u in g) for g in groups]
        assert all(n <= limit or len(g) == 1 for n, g in zip(size, groups)), (limit, size)
        assert all(size[i] + sizes[groups[i + 1][0].sample_id] > limit for i in range(len(groups) - 1)), (limit, size)
    assert [len(g) for g in chunk_units(units, ends[1])] == [3, 2]  # exactly the first two's bytes, + one of 0 bytes
    assert chunk_units(units, None) == [units] and chunk_units([], 5) == [[]] and chunk_units([], None) == [[]]


@pytest.mark.parametrize("src,dsts", [(0, [1.5]), (0, [True]), (0.0, [1]), (0, 1), (0, "1"), ("0", [1])])
def test_ranks_that_are_no_ints_are_named_before_the_process_group(src, dsts):
    """int() took a rank 1.5 (or True) as 1: a peer that was not named; dsts=1 was a bare TypeError."""
    with pytest.raises(ValueError, match=re.escape(f"src={src!r} must be an int rank and dsts={dsts!r} a list of int "
                                                   "ranks")):
        GuidanceSync(src, dsts, timeout=timedelta(seconds=1))
