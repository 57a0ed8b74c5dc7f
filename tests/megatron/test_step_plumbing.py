"""Index and flag plumbing of the guided step (``StepState.token_index``, ``host_values`` of mixed dtypes)."""

import dataclasses

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.site import FallbackCounter
from megatron_trace.kernels.checks import host_values
from megatron_trace.megatron.rows import token_major
from megatron_trace.megatron.step import StepState, counted_valid


def _state() -> StepState:
    return StepState(config=TraceConfig(), counter=FallbackCounter(), fallback="rne", guided_layers=frozenset())


def test_token_index_is_token_major_order():
    st = _state()
    b, s, h = 3, 8, 4
    rows = torch.arange(b * s * h).view(b, s, h)
    for seq in (slice(0, s), slice(2, 6)):
        assert torch.equal(st.token_index(b, s, seq, "cpu"), token_major(torch.arange(b * s).view(b, s), seq))
        for local in (slice(0, h), slice(2, 4)):
            want = token_major(rows, seq)[:, local].reshape(-1)
            assert torch.equal(st.token_index(b, s, seq, "cpu", h, local), want)
            assert torch.equal(st.token_index(b, s, seq, "cpu", h, local, of_token=True), want // h)
    assert st.token_index(b, s, slice(0, s), "cpu") is st.token_index(b, s, slice(0, s), "cpu")  # once per step



def test_counted_valid_counts_valid_rows_of_real_tokens_only():
    """Valid rows at padding positions are not used rows: by hand, rows valid and real. (With a token mask the
    shortcut for "every token, each once" counted the padding's valid rows too: more used rows than counted ones.)"""
    st = _state()
    valid = torch.tensor([[True, True, True, True], [True, False, True, True]])
    real = torch.tensor([[True, True, True, False], [True, True, False, False]])
    token = st.token_index(2, 4, slice(0, 4), "cpu")
    assert int(counted_valid(valid, token_major(real, slice(0, 4)), token)) == 4  # (0,0) (0,1) (0,2) (1,0)
    assert int(counted_valid(valid, None, token)) == 7
    half = st.token_index(2, 4, slice(2, 4), "cpu")  # a sequence-parallel rank's positions 2..3
    assert int(counted_valid(valid, token_major(real, slice(2, 4)), half)) == 1  # (0,2)

def test_host_values_of_mixed_dtypes_keep_their_order():
    g = torch.Generator().manual_seed(0)
    flags = list((torch.rand(70, generator=g) > 0.5).unbind(0))
    ints = list(torch.randint(-5, 99, (9,), generator=g).unbind(0))
    mixed = [t for pair in zip(flags, ints) for t in pair] + flags[9:] + [torch.tensor([7], dtype=torch.int32)]
    assert host_values(mixed) == [int(t.item()) for t in mixed]


def test_ready_points_are_known_only_after_every_producer_marked():
    """A counter's ``tensor()`` (a producer about to add) forgets its ready point until ``mark()``; the step state's
    point moves with each count / check it holds, and ``views`` of the state share it. (The side-stream read itself
    needs CUDA: tests/gpu/test_checks_gpu.py.)"""
    from megatron_trace.kernels.checks import FiniteCounter, count_ready, read_and_reset

    c = FiniteCounter("site")
    assert c.ready.known and count_ready([c]) == []  # unused
    c.tensor("cpu").add_(3)
    assert not c.ready.known
    c.mark()
    assert c.ready.known and count_ready([c]) == [c.ready]
    c.add_bad(torch.tensor([True, False, True]))
    assert c.ready.known and read_and_reset([c]) == [("site", 5)] and c.ready.known
    st = _state()
    view = dataclasses.replace(st, guided_layers=frozenset({1}))
    assert view.ready is st.ready
    view.defer_check(torch.tensor(False), "never")
    view.count(0, "fc1", torch.tensor(4), {})
    assert st.resolve(extra=[c.tensor("cpu")], extra_ready=count_ready([c])) == [0]


def _recorded():
    """A 4-layer model guiding every layer, a batch, and the trainer's own recording of it (a rollout stand-in)."""
    from megatron_trace.megatron import trace_record, trace_spec

    from .harness import batch, build_model, stock_spec, tiny_config

    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(guided_layers="all")))
    data = batch()
    with trace_record(model) as h, torch.no_grad():
        model(*data[:3])
    return model, data, h.recorded()


def _guided_run(routing_edit):
    from megatron_trace.megatron import StepGuidance, trace_guidance

    model, data, roll = _recorded()
    routing = {k: r.clone() for k, r in roll.routing.items()}
    routing_edit(routing)
    with trace_guidance(model, StepGuidance(sites=roll.sites, routing=routing)) as h, torch.no_grad():
        model(*data[:3])
    return h


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("index", ["num_experts", -1])
def test_out_of_range_routing_names_its_layer(index):
    """Past the last expert, or negative (which indexing would take as the last expert)."""
    from .harness import EXPERTS

    def edit(routing):
        routing[1][0, 3, 0] = EXPERTS if index == "num_experts" else index

    with pytest.raises(ValueError, match=r"routing indices for layer 1 must be in") as e:
        _guided_run(edit)
    assert "layer 0" not in str(e.value)


@pytest.mark.usefixtures("world1")
def test_routing_of_a_longer_sequence_is_refused_not_cut():
    """The rollout's routing for 16 positions given to a 12-position batch: its first 12 positions need not be the
    batch's tokens (left padding), so it is refused by shape, as the records of that layout are."""
    from megatron_trace.megatron import StepGuidance, trace_guidance

    model, data, roll = _recorded()
    tokens, pos, mask, _ = data
    B, S = tokens.shape
    with pytest.raises(ValueError, match=rf"routing indices for layer 0 have shape \({B}, {S}, 2\); the batch needs "
                                         rf"\[B={B}, S={S - 4}, topk=2\]"):
        with trace_guidance(model, StepGuidance(routing=roll.routing)), torch.no_grad():
            model(tokens[:, : S - 4], pos[:, : S - 4], mask[..., : S - 4, : S - 4])


@pytest.mark.usefixtures("world1")
def test_repeated_replayed_expert_routes_fewer_rows():
    """A token whose replayed top-k repeats an expert (found per step: the rows are then laid out with
    ``nonzero``) has fewer FC2 rows; every other row is still guided."""
    from .harness import TOPK

    def edit(routing):
        routing[0][0, 3, 1] = routing[0][0, 3, 0]

    h = _guided_run(edit)
    stats = h.stats()
    full = sum(v for (layer, site, k), v in stats.items() if layer == 1 and site == "expert_fc2_in")
    assert stats[(0, "expert_fc2_in", "used")] + stats.get((0, "expert_fc2_in", "expert_mismatch"), 0) == full - 1
    assert full % TOPK == 0


@pytest.mark.usefixtures("world1")
def test_a_slot_the_replay_routes_no_fc2_row_is_recorded_invalid():
    """The replayed top-k of token (0, 3) repeats an expert: one FC2 row for its two slots. The recording marks the
    slot without a row invalid (its codes are zeros, not codes the trainer used), every other slot valid, with the
    expert ids replayed."""
    from megatron_trace.megatron import StepGuidance, trace_guidance

    model, data, roll = _recorded()
    routing = {k: r.clone() for k, r in roll.routing.items()}
    routing[0][0, 3, 1] = routing[0][0, 3, 0]
    with trace_guidance(model, StepGuidance(routing=routing), record=True) as h, torch.no_grad():
        model(*data[:3])
    rec = h.recorded()
    fc2 = rec.sites[(0, "expert_fc2_in")]
    want = torch.ones_like(fc2.valid)
    want[0, 3, 1] = False
    assert torch.equal(fc2.valid, want)
    assert torch.equal(fc2.expert_ids, routing[0]) and torch.equal(rec.routing[0], routing[0])
    assert bool(rec.sites[(1, "expert_fc2_in")].valid.all())


@pytest.mark.usefixtures("world1")
def test_find_trace_layers_walks_a_model_once():
    from megatron_trace.megatron import find_trace_layers, trace_spec

    from .harness import build_model, stock_spec, tiny_config

    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig()))
    first = find_trace_layers(model)
    assert find_trace_layers(model) is first and find_trace_layers([model]) is first  # per step: no second walk
    other = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig()))
    assert find_trace_layers(other) is not first  # another model is walked
    assert not any("_trace_layers" in k for k in model.state_dict())


@pytest.mark.usefixtures("world1")
def test_guidance_to_moves_every_tensor_and_keeps_the_counter():
    """What ``trace_guidance`` does on a GPU model with host guidance (the RL driver's assembled records)."""
    import dataclasses

    from megatron_trace.megatron import StepGuidance
    from megatron_trace.megatron.context import guidance_to

    _, (tokens, *_), rec = _recorded()
    step = StepGuidance(sites=rec.sites, routing=rec.routing, token_mask=torch.ones(tokens.shape, dtype=torch.bool))
    moved = guidance_to(step, "meta")
    assert moved.counter is step.counter and moved.sites.keys() == step.sites.keys()
    tensors = lambda s: [t for sg in s.sites.values() for t in (  # noqa: E731
        sg.valid, sg.expert_ids, *(getattr(sg.record, f.name) for f in dataclasses.fields(sg.record)))
        if isinstance(t, torch.Tensor)] + list(s.routing.values()) + [s.token_mask]
    assert all(t.is_meta for t in tensors(moved))
    assert [t.shape for t in tensors(moved)] == [t.shape for t in tensors(step)]
    same = guidance_to(step, "cpu")  # already there: the same tensors, no copies
    assert all(a is b for a, b in zip(tensors(same), tensors(step)))
    part = guidance_to(step, "meta", layers=[1])  # a pipeline stage moves its own layers only
    assert all(sg.valid.is_meta == (key[0] == 1) for key, sg in part.sites.items())
    assert all(r.is_meta == (layer == 1) for layer, r in part.routing.items())
    kept = guidance_to(step, "meta", records=False)  # several micro-batches: each layer moves its own records
    assert all(sg.valid.is_meta and not sg.record.block_scales.is_meta for sg in kept.sites.values())


@pytest.mark.usefixtures("world1")
def test_padding_that_repeats_an_expert_is_replayed_without_nonzero():
    """Rollouts fill the routing of padding positions with expert 0, a repeated expert. With the step's
    ``token_mask`` those positions are replayed as experts 0..k-1, so the guided step lays out its rows without
    ``nonzero`` (a host sync per MoE layer on the GPU); every real token's logits equal the ``nonzero`` path's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_trace.megatron import StepGuidance, trace_guidance

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    model, (tokens, pos, mask, _), roll = _recorded()
    real = torch.ones(tokens.shape, dtype=torch.bool)
    real[0, -3:] = False  # the last 3 positions of row 0 are padding
    routing = {k: r.clone() for k, r in roll.routing.items()}
    for r in routing.values():
        r[0, -3:] = 0
    given = {k: r.clone() for k, r in routing.items()}
    logits, names, grads = {}, {}, {}
    for key, token_mask in (("masked", real), ("unmasked", None)):
        ops = Ops()
        model.zero_grad(set_to_none=True)
        with trace_guidance(model, StepGuidance(sites=roll.sites, routing=routing, token_mask=token_mask)):
            with ops:
                logits[key] = model(tokens, pos, mask)
            logits[key].float()[real].square().mean().backward()  # a loss on real tokens only
        names[key] = ops.names
        grads[key] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert "nonzero" not in names["masked"] and "nonzero" in names["unmasked"]
    assert torch.equal(logits["masked"][real], logits["unmasked"][real])
    assert grads["masked"].keys() == grads["unmasked"].keys()
    assert all(torch.equal(g, grads["unmasked"][n]) for n, g in grads["masked"].items())
    assert all(torch.equal(routing[k], given[k]) for k in routing)  # the caller's routing is not modified


def test_check_site_rejects_records_that_cannot_serve_the_site(caplog):
    """Each rejected as a whole (``shape``, the trainer's own rounding), or raised with ``fail``: compact records for
    ``cache_mode='full'`` (no codes to round to), an MXFP4 record carrying a global amax (not the format's
    scaling), FC2 records without the experts they were computed for."""
    import logging

    from megatron_trace.formats import Quantizer
    from megatron_trace.guidance.site import SiteGuidance
    from megatron_trace.megatron.step import SHAPE, GuidanceFallbackError, check_site

    x = torch.randn(2, 5, 64).bfloat16()
    valid = torch.ones(2, 5, dtype=torch.bool)
    nv = Quantizer("nvfp4", per_row=True).quantize(x)
    mx = Quantizer("mxfp4").quantize(x).guidance(compact=False)
    cases = [
        (SiteGuidance(nv.guidance(compact=True), valid), "expert_fc1_in", (64,), TraceConfig(), "cannot serve"),
        (SiteGuidance(dataclasses.replace(mx, global_amax=torch.ones(2, 5, 1)), valid), "expert_fc1_in", (64,),
         TraceConfig(format="mxfp4"), "must not carry a global_amax"),
        (SiteGuidance(nv.guidance(compact=False), valid), "expert_fc2_in", (64,), TraceConfig(), "needs expert_ids"),
    ]
    for sg, site, rows, cfg, problem in cases:
        kw = dict(site=site, layer=0, rows=rows, config=cfg, compact=False)
        with caplog.at_level(logging.WARNING):
            c = check_site(sg, fail=False, **kw)
        assert c.sg is None and c.reason == SHAPE and problem in caplog.text, problem
        with pytest.raises(GuidanceFallbackError, match=problem):
            check_site(sg, fail=True, **kw)
    ok = check_site(SiteGuidance(nv.guidance(compact=False), valid), site="expert_fc1_in", layer=0, rows=(64,),
                    config=TraceConfig(cache_mode="compact"), compact=True, fail=True)
    assert ok.sg is not None and ok.sg.compact  # full -> compact is derived


def test_deferred_checks_raise_at_the_read_after_the_counts_are_applied():
    """A deferred device check that came out True raises at the step's one read (all failed messages, in order),
    and the counts pending with it are applied first; one that came out False does not."""
    from megatron_trace.megatron.step import resolve_states

    a, b = _state(), _state()
    a.defer_check(torch.tensor(False), "never")
    a.count(0, "kv_k", torch.tensor(4), {})
    b.defer_check(torch.tensor(True), "rows per expert did not match")
    b.defer_check(torch.tensor(True), "second")
    with pytest.raises(RuntimeError, match="^rows per expert did not match; second$"):
        resolve_states([a, b])
    assert a.counter.used == 4 and not a.pending and not b.deferred
    a.defer_check(torch.tensor(False), "never")
    assert a.resolve() == []


@pytest.mark.usefixtures("world1")
def test_a_real_token_that_repeats_an_expert_is_laid_out_with_nonzero_whatever_the_padding():
    """Padding positions whose replayed experts are distinct, and a real token that repeats one: the rows are not
    distinct on the real tokens (where it matters), so the masked step routes exactly as the unmasked one."""
    from megatron_trace.megatron import StepGuidance, trace_guidance

    model, (tokens, pos, mask, _), roll = _recorded()
    real = torch.ones(tokens.shape, dtype=torch.bool)
    real[0, -3:] = False  # padding, with the rollout's own (distinct) experts
    routing = {k: r.clone() for k, r in roll.routing.items()}
    for r in routing.values():
        r[1, 5, 1] = r[1, 5, 0]  # a real token routed to one expert twice
    logits, stats = {}, {}
    for key, token_mask in (("masked", real), ("unmasked", None)):
        with trace_guidance(model, StepGuidance(sites=roll.sites, routing=routing, token_mask=token_mask)) as h, \
                torch.no_grad():
            logits[key] = model(tokens, pos, mask)
        stats[key] = h.stats()
    assert torch.equal(logits["masked"][real], logits["unmasked"][real])
    for layer in routing:  # one FC2 row fewer: token (1, 5) has one row for its two slots
        st = stats["masked"]
        assert st[(layer, "expert_fc2_in", "used")] + st.get((layer, "expert_fc2_in", "expert_mismatch"), 0) == \
            2 * (tokens.numel() - 3) - 1


@pytest.mark.usefixtures("world1")
def test_fc2_records_of_another_expert_than_the_replayed_one_are_not_used():
    """Every FC2 record is valid, but token (0, 3)'s first slot is replayed to another expert than its record's:
    that row falls back (counted ``expert_mismatch``), as it must (the record's codes are another expert's row)."""
    from .harness import EXPERTS, TOPK

    def edit(routing):
        r = routing[2][0, 3]
        r[0] = next(e for e in range(EXPERTS) if e not in r.tolist())

    stats = _guided_run(edit).stats()
    assert stats[(2, "expert_fc2_in", "expert_mismatch")] == 1
    assert stats[(2, "expert_fc2_in", "used")] == 2 * 16 * TOPK - 1
    assert stats[(1, "expert_fc2_in", "used")] == 2 * 16 * TOPK
