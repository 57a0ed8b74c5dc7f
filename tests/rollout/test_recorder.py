"""``rollout.recorder.GuidanceRecorder`` on its own: the records and routing of a prefill, a fork of the batch rows
and decode steps, re-indexed to the output layout, equal the per-row quantization of the whole sequence taken at
once (per-row amax: a row's record depends on that row only), gathered at the output positions."""

import pytest
import torch

from megatron_trace.formats import Quantizer
from megatron_trace.rollout.recorder import GuidanceRecorder

H, TOPK, HEADS, D = 32, 2, 2, 32
PER_ROW = Quantizer("nvfp4", per_row=True)
FC1, FC2 = (1, "expert_fc1_in"), (1, "expert_fc2_in")

# internal (left-padded) layout: prefill of width 3 for 2 prompts (lengths 3, 1), a fork to rows [1, 1, 0], then
# two decode steps of the 3 rows (row 1 stops after its first token)
FORK = torch.tensor([1, 1, 0])
STEP_VALID = [torch.tensor([[False, False, True], [True, True, True]]),
              torch.tensor([[True], [True], [True]]), torch.tensor([[True], [False], [True]])]
# output positions -> internal ones, valid there: row 0's position 3 lies beyond the 5 recorded positions, row 1's
# position 2 is the input of a finished row and row 2's 0 and 1 are left padding (internal valid False): not OK
INDEX = torch.tensor([[2, 3, 4, 7, 5], [2, 3, 4, 5, 5], [0, 1, 2, 3, 4]])
VALID = torch.tensor([[True, True, True, True, False], [True, True, True, False, False], [True] * 5])
OK = torch.tensor([[True, True, True, False, False], [True, True, False, False, False],
                   [False, False, True, True, True]])


def _payload(rec):
    return rec.mantissa_bits if hasattr(rec, "mantissa_bits") else rec.codes


def _expected(whole, compact: bool):
    """``whole`` [B, n, *row]: its records gathered at INDEX, zeros where not OK."""
    g = PER_ROW.quantize(whole.reshape(-1, whole.shape[-1])).guidance(compact)
    lead = whole.shape[:-1]
    out = []
    for t in (_payload(g), g.block_scales.view(torch.uint8), g.global_amax):
        t = t.reshape(*lead, t.shape[-1])
        picked = torch.stack([t[b, INDEX[b].clamp(max=whole.shape[1] - 1)] for b in range(len(INDEX))])
        keep = OK.reshape(*OK.shape, *[1] * (picked.dim() - 2))
        out.append(torch.where(keep, picked, torch.zeros((), dtype=picked.dtype)))
    return out


def _assert_record(rec, whole, compact: bool):
    payload, scales, amax = _expected(whole, compact)
    assert tuple(rec.shape) == (*INDEX.shape, *whole.shape[2:])
    assert torch.equal(_payload(rec), payload)
    assert torch.equal(rec.block_scales.view(torch.uint8), scales)
    assert torch.equal(rec.global_amax, amax)


@pytest.mark.parametrize("compact, static", [(True, False), (False, False), (True, True)])
def test_records_and_routing_are_the_whole_sequences_at_the_output_positions(compact, static):
    """``static``: the decode steps go to the fixed buffers of ``begin_static``, and the fork comes after the first
    of them (the buffers' rows are forked with the rest)."""
    gen = torch.Generator().manual_seed(0)
    rec = GuidanceRecorder(2, {FC1, FC2}, compact=compact, kernel="reference")
    xs1, xs2, ids, routing0 = [], [], [], []
    step_index = None
    for i, valid in enumerate(STEP_VALID):
        if static and i == 1:
            valid = torch.ones(2, 1, dtype=torch.bool)  # (before the fork)
            step_index = rec.begin_static(2, torch.device("cpu"))
        if step_index is not None:
            step_index.fill_(i - 1)
        b, t = valid.shape
        x1, x2 = torch.randn(b, t, H, generator=gen), torch.randn(b, t, TOPK, H, generator=gen)
        k1, k0 = torch.randint(0, 8, (b, t, TOPK), generator=gen), torch.randint(0, 8, (b, t, TOPK), generator=gen)
        rec.add_routing(1, k1.reshape(b * t, TOPK).int())  # (as a router gives them: int32)
        rec.add_routing(0, k0.reshape(b * t, TOPK).int())
        rec.add_rows(1, "expert_fc1_in", PER_ROW.quantize(x1.reshape(b * t, H)))
        rec.add_rows(1, "expert_fc2_in", PER_ROW.quantize(x2.reshape(b * t, TOPK, H)))
        rec.add_rows(0, "expert_fc1_in", PER_ROW.quantize(x1.reshape(b * t, H)))  # not a recorded site: ignored
        rec.end_step(valid)
        xs1.append(x1), xs2.append(x2), ids.append(k1), routing0.append(k0)
        if i == (1 if static else 0):
            rec.select_rows(FORK)
            xs1, xs2, ids, routing0 = ([t[FORK] for t in ts] for ts in (xs1, xs2, ids, routing0))
    assert rec.recorded_positions == 5 and rec.batch_size == 3
    routing, guidance = rec.finish(INDEX, VALID)
    assert set(routing) == {0, 1} and set(guidance) == {FC1, FC2}
    for layer, k in ((1, ids), (0, routing0)):
        whole = torch.cat(k, 1)
        want = torch.stack([whole[b, INDEX[b].clamp(max=4)] for b in range(3)])
        assert routing[layer].dtype == torch.int64
        assert torch.equal(routing[layer], torch.where(OK.unsqueeze(-1), want, 0))
    g1, g2 = guidance[FC1], guidance[FC2]
    assert g1.compact == compact and torch.equal(g1.valid, OK) and g1.expert_ids is None
    _assert_record(g1.record, torch.cat(xs1, 1), compact)
    _assert_record(g2.record, torch.cat(xs2, 1), compact)
    assert torch.equal(g2.expert_ids, routing[1]) and torch.equal(g2.valid, OK.unsqueeze(-1).expand(-1, -1, TOPK))


def _kv_steps(gen):
    """Per-step K rows [B, heads, t, D] of the internal layout (the fork applied after the prefill)."""
    steps = [torch.randn(v.shape[0], HEADS, v.shape[1], D, generator=gen) for v in STEP_VALID]
    return steps, torch.cat([steps[0][FORK], *steps[1:]], 2)


def _kv_recorder(key):
    rec = GuidanceRecorder(2, {key}, compact=True, kernel="reference")
    for i, valid in enumerate(STEP_VALID):
        rec.end_step(valid)
        if i == 0:
            rec.select_rows(FORK)
    return rec


def test_kv_records_per_step_and_from_the_stored_history_are_batch_then_position_then_head():
    gen = torch.Generator().manual_seed(1)
    key = (0, "kv_k")
    steps, whole = _kv_steps(gen)  # whole [3, heads, 5, D]
    want = whole.transpose(1, 2)  # [3, 5, heads, D]: what a position's record holds, head by head

    per_step = GuidanceRecorder(2, {key}, compact=True, kernel="reference")
    for i, (k, valid) in enumerate(zip(steps, STEP_VALID, strict=True)):
        per_step.add_heads_major(*key, PER_ROW.quantize(k))
        per_step.end_step(valid)
        if i == 0:
            per_step.select_rows(FORK)
    _assert_record(per_step.finish(INDEX, VALID)[1][key].record, want, True)

    calls = []
    history = _kv_recorder(key)
    history.add_kv_history(*key, lambda: calls.append(1) or PER_ROW.quantize(whole))
    history.add_kv_history(*key, lambda: PER_ROW.quantize(torch.zeros_like(whole)))  # (every step: the first stays)
    history.add_kv_history(1, "kv_v", lambda: PER_ROW.quantize(torch.zeros_like(whole)))  # not recorded: ignored
    assert not calls  # read once, at the end
    routing, guidance = history.finish(INDEX, VALID)
    assert len(calls) == 1 and set(guidance) == {key} and torch.equal(guidance[key].valid, OK)
    _assert_record(guidance[key].record, want, True)


def test_kv_history_errors_name_what_disagrees():
    key = (0, "kv_v")
    rec = GuidanceRecorder(2, {key}, compact=True)
    rec.add_heads_major(*key, PER_ROW.quantize(torch.randn(2, HEADS, 3, D)))
    with pytest.raises(ValueError, match=r"site \(0, 'kv_v'\) already has per-step records"):
        rec.add_kv_history(*key, lambda: None)
    rec = _kv_recorder(key)
    rec.add_kv_history(*key, lambda: PER_ROW.quantize(torch.randn(3, HEADS, 4, D)))
    with pytest.raises(ValueError, match=r"site \(0, 'kv_v'\) is recorded from its stored history; it cannot also "
                                         "have per-step records"):  # (the other order: its records would be dropped)
        rec.add_heads_major(*key, PER_ROW.quantize(torch.randn(3, HEADS, 1, D)))
    with pytest.raises(ValueError, match=r"site \(0, 'kv_v'\) is recorded from its stored history"):
        rec.add_rows(*key, PER_ROW.quantize(torch.randn(3, HEADS * D)))  # (token-major rows: dropped the same way)
    with pytest.raises(ValueError, match=r"history of \(0, 'kv_v'\) has 4 positions but 5 were recorded"):
        rec.finish(INDEX, VALID)
    rec = GuidanceRecorder(2, {key}, compact=True)
    rec.begin_static(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot be kept in static steps"):
        rec.add_heads_major(*key, PER_ROW.quantize(torch.randn(2, HEADS, 1, D)))


def test_a_recorder_of_static_steps_only_returns_their_routing_and_records():
    gen = torch.Generator().manual_seed(2)
    rec = GuidanceRecorder(2, {FC1}, compact=True, kernel="reference")
    step = rec.begin_static(2, torch.device("cpu"))
    xs = [torch.randn(2, 1, H, generator=gen) for _ in range(2)]
    ids = [torch.randint(0, 8, (2, 1, TOPK), generator=gen) for _ in range(2)]
    for i in range(2):
        step.fill_(i)
        rec.add_routing(1, ids[i].reshape(2, TOPK))
        rec.add_rows(*FC1, PER_ROW.quantize(xs[i].reshape(2, H)))
        rec.end_step(torch.ones(2, 1, dtype=torch.bool))
    routing, guidance = rec.finish(torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2, dtype=torch.bool))
    assert set(routing) == {1} and torch.equal(routing[1], torch.cat(ids, 1))
    want = PER_ROW.quantize(torch.cat(xs, 1).reshape(4, H)).guidance(compact=True)
    assert torch.equal(guidance[FC1].record.mantissa_bits, want.mantissa_bits.reshape(2, 2, -1))


@pytest.mark.parametrize("extra", ["routing", "rows", "missing"])
def test_records_of_more_or_fewer_steps_than_end_step_counted_are_refused(extra):
    """A layer's routing or a site's rows recorded on a step that had no ``end_step`` (or missing from a step) were
    gathered at other positions with no error, as long as there were at least as many."""
    gen = torch.Generator().manual_seed(2)
    rec = GuidanceRecorder(2, {FC1}, compact=True, kernel="reference")
    for valid in STEP_VALID[:2] if extra != "missing" else STEP_VALID[:1]:  # 3 + 1 positions of 2 rows
        valid = valid[:2]
        rows = valid.numel()
        rec.add_routing(1, torch.randint(0, 8, (rows, TOPK), generator=gen))
        rec.add_rows(*FC1, PER_ROW.quantize(torch.randn(rows, H, generator=gen)))
        rec.end_step(valid)
    if extra == "routing":
        rec.add_routing(1, torch.randint(0, 8, (2, TOPK), generator=gen))
        what = r"layer 1's routing has 5 recorded positions but end_step counted 4"
    elif extra == "rows":
        rec.add_rows(*FC1, PER_ROW.quantize(torch.randn(2, H, generator=gen)))
        what = r"site \(1, 'expert_fc1_in'\) has 5 recorded positions but end_step counted 4"
    else:
        rec.end_step(torch.ones(2, 1, dtype=torch.bool))  # a step that recorded nothing
        what = r"layer 1's routing has 3 recorded positions but end_step counted 4"
    index = torch.arange(4).expand(2, 4)
    with pytest.raises(ValueError, match=what):
        rec.finish(index, torch.ones(2, 4, dtype=torch.bool))



@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=2.0), r"GuidanceRecorder.batch_size=2.0 must be an int >= 1"),
    (dict(batch_size=0), r"GuidanceRecorder.batch_size=0 must be an int >= 1"),
    (dict(compact="no"), r"GuidanceRecorder: compact='no' must be a bool"),
    (dict(kernel="cuda"), r"kernel='cuda' is not one of \('auto', 'reference', 'triton'\)"),
    (dict(sites={("1", "expert_fc1_in")}), r"sites has \('1', 'expert_fc1_in'\): a site is \(layer >= 0, one of"),
    (dict(sites={(1, "fc1")}), r"sites has \(1, 'fc1'\)"),
    (dict(sites={"expert_fc1_in"}), r"sites has 'expert_fc1_in'"),
])
def test_recorder_settings_are_checked_by_name(kw, match):
    """compact="no" (truthy) recorded compact records; a site keyed ("1", ...) or (1, "fc1") was never asked for by a
    forward, and its records were missing from the batch without a word."""
    args = dict(batch_size=2, sites={FC1}, compact=False, kernel="reference") | kw
    with pytest.raises(ValueError, match=match):
        GuidanceRecorder(**args)
