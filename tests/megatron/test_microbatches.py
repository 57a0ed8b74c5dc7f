"""One ``trace_guidance`` context around Megatron's ``forward_backward_func`` with one ``StepGuidance`` per
micro-batch: the same gradients, records and counts, bit for bit, as one context per micro-batch, with and without
activation recomputation (pipeline parallelism: test_pipeline.py)."""

import re

import numpy as np
import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.site import FallbackCounter
from megatron_trace.megatron import StepGuidance, trace_guidance, trace_spec

from .harness import SEQ, batch, build_model, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")

TC = TraceConfig(guided_layers="last_k", guided_last_k=2, sites=("expert_fc1_in", "expert_fc2_in", "weights",
                                                                 "kv_k", "kv_v"))
N = 4  # micro-batches (a power of two: the schedule's loss / N is exact, like the reference's)
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    # one checkpoint of 2 layers (its recompute pass runs both layers' forwards), the other 2 layers not recomputed
    "full_block_2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "selective_core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
}


def _model(**mcfg):
    cfg = tiny_config(**mcfg)
    return build_model(cfg, trace_spec(stock_spec(cfg), TC))


@pytest.fixture(scope="module")
def rollout():
    return make_rollout()


def make_rollout():
    """N micro-batches and their rollout guidance (a slightly different model). Micro-batch 0 has padding at its
    last 3 positions, replayed there as expert 0 twice (what the rollouts fill padding with); micro-batch 2 routes
    its last real token to one expert twice, at the same positions: each micro-batch's padding must be its own."""
    roll = _model(init_method_std=0.051)
    micro = [batch(seed=s) for s in range(N)]
    steps = []
    for tokens, pos, mask, _ in micro:
        with trace_guidance(roll, record=True, compact=False) as h, torch.no_grad():
            roll(tokens, pos, mask)
        steps.append(h.recorded())
    masks = [None] * N
    masks[0] = torch.ones(2, SEQ, dtype=torch.bool)
    masks[0][:, -3:] = False
    for layer, r in steps[0].routing.items():
        r[:, -3:] = 0
        steps[2].routing[layer][:, -1] = steps[2].routing[layer][:, -1, :1]
    return micro, [(s, m) for s, m in zip(steps, masks)]


def _steps(guidance, counter: FallbackCounter) -> list[StepGuidance]:
    return [StepGuidance(sites=g.sites, routing=g.routing, token_mask=m, counter=counter) for g, m in guidance]


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _per_microbatch(model, micro, guidance):
    """The reference: one context per micro-batch, forward and backward inside, the loss / N."""
    counter, recorded, stats = FallbackCounter(), [], {}
    for (tokens, pos, mask, labels), step in zip(micro, _steps(guidance, counter)):
        with trace_guidance(model, step, record=True, compact=False) as h:
            (model(tokens, pos, mask, labels=labels).float().mean() / N).backward()
        recorded.append(h.recorded())
        for key, v in h.stats().items():
            stats[key] = stats.get(key, 0) + v
    return _grads(model), recorded, stats, counter


def forward_step(data_iterator, model):
    tokens, pos, mask, labels = next(data_iterator)
    return model(tokens, pos, mask, labels=labels), lambda out: (out.float().mean(), {})


def _schedule(model, micro, num_microbatches=N):
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[model], num_microbatches=num_microbatches,
        seq_length=SEQ, micro_batch_size=2, forward_only=False)


def _one_context(model, micro, guidance):
    counter = FallbackCounter()
    with trace_guidance(model, _steps(guidance, counter), record=True, compact=False) as h:
        _schedule(model, micro)
    return _grads(model), [h.microbatch(i).recorded() for i in range(N)], h.stats(), h.counter


def _same_records(got, want) -> None:
    assert got.routing.keys() == want.routing.keys() and got.sites.keys() == want.sites.keys()
    for layer, r in want.routing.items():
        assert torch.equal(got.routing[layer], r), layer
    for key, sg in want.sites.items():
        assert torch.equal(got.sites[key].record.codes, sg.record.codes), key
        assert torch.equal(got.sites[key].record.block_scales, sg.record.block_scales), key


@pytest.mark.parametrize("kind", list(RECOMPUTE))
def test_one_context_over_the_schedule_equals_a_context_per_microbatch(rollout, kind):
    micro, guidance = rollout
    g0, r0, s0, c0 = _per_microbatch(_model(), micro, guidance)
    g1, r1, s1, c1 = _one_context(_model(**RECOMPUTE[kind]), micro, guidance)
    assert c0.used > 0 and c0.fallback["not_guided_layer"] > 0 and c0.fallback["invalid_row"] == 0
    assert s1 == s0 and (c1.used, dict(c1.fallback)) == (c0.used, dict(c0.fallback))  # each row counted once
    assert g1.keys() == g0.keys() and all(torch.equal(g1[n], g0[n]) for n in g0)
    for got, want in zip(r1, r0):
        _same_records(got, want)


@pytest.mark.parametrize("modules", [["moe"], ["moe", "shared_experts"]])
def test_shared_experts_recomputed_in_the_moe_checkpoint(rollout, modules):
    """With shared experts and recompute_modules ["moe", "shared_experts"], the shared experts' checkpoint, nested
    in the MoE layer's, clears Megatron's checkpointing flag before the router runs, in both passes: the recompute
    pass must still be told from a new forward (the same micro-batch's guidance, rows counted once), whether one
    context spans the schedule or each micro-batch has its own."""
    micro, guidance = rollout
    shared = dict(moe_shared_expert_intermediate_size=64)
    g0, r0, s0, c0 = _per_microbatch(_model(**shared), micro, guidance)
    recompute = dict(shared, recompute_granularity="selective", recompute_modules=modules)
    for g1, r1, s1, c1 in (_one_context(_model(**recompute), micro, guidance),
                           _per_microbatch(_model(**recompute), micro, guidance)):
        assert s1 == s0 and (c1.used, dict(c1.fallback)) == (c0.used, dict(c0.fallback))
        assert g1.keys() == g0.keys() and all(torch.equal(g1[n], g0[n]) for n in g0)
        for got, want in zip(r1, r0):
            _same_records(got, want)


def test_the_microbatches_guidance_is_not_interchangeable(rollout):
    """The check above has teeth: micro-batch 1's guidance in micro-batch 0's place changes the gradients."""
    micro, guidance = rollout
    g0, *_ = _one_context(_model(), micro, guidance)
    g1, *_ = _one_context(_model(), micro, [guidance[1], guidance[0], *guidance[2:]])
    assert any(not torch.equal(g1[n], g0[n]) for n in g0)


def test_more_forwards_than_steps_raise(rollout):
    micro, guidance = rollout
    model = _model()
    with pytest.raises(RuntimeError, match=f"ran forward {N} inside one trace_guidance context given guidance "
                                           f"for {N - 1} micro-batches"):
        with trace_guidance(model, _steps(guidance[:-1], FallbackCounter())):
            _schedule(model, micro)
    _one_context(model, micro, guidance)  # the model is usable after


def test_steps_left_unused_raise(rollout):
    micro, guidance = rollout
    model = _model()
    with pytest.raises(ValueError, match=rf"guidance for {N} micro-batches but layers \[0, 1, 2, 3\] ran \[{N - 1}\]"):
        with trace_guidance(model, _steps(guidance, FallbackCounter())):
            _schedule(model, micro, num_microbatches=N - 1)


def test_bad_step_lists_are_refused(rollout):
    _, guidance = rollout
    model = _model()
    with pytest.raises(ValueError, match="empty list"):
        with trace_guidance(model, []):
            pass
    with pytest.raises(TypeError, match="must hold StepGuidance objects, got \\['dict'\\]"):
        with trace_guidance(model, [{}]):
            pass
    with pytest.raises(TypeError, match="got dict"):
        with trace_guidance(model, {0: None}):
            pass
    partial = _steps(guidance[:2], FallbackCounter())
    partial[1] = StepGuidance(sites=partial[1].sites, routing={k: v for k, v in partial[1].routing.items() if k})
    with pytest.raises(ValueError, match=r"micro-batch 1: routing indices are missing for MoE layers \[0\]"):
        with trace_guidance(model, partial):
            pass
    with trace_guidance(model, _steps(guidance[:2], FallbackCounter())) as h:
        tokens, pos, mask, _ = batch()
        with torch.no_grad():
            model(tokens, pos, mask)
            model(tokens, pos, mask)
    with pytest.raises(ValueError, match=r"h.microbatch\(i\).recorded\(\)"):
        h.recorded()
    with pytest.raises(IndexError, match=r"micro-batch 2 of 2: the index must be in \[-2, 2\)"):
        h.microbatch(2)
    assert h.microbatch(-1).states[0] is h.states[1] and h.microbatch(np.int64(0)).states[0] is h.states[0]
    for bad in (True, False, 1.0, "0", None):  # (True was micro-batch 1, the others a bare TypeError)
        with pytest.raises(TypeError, match=rf"micro-batch index {re.escape(repr(bad))} must be an int in \[-2, 2\)"):
            h.microbatch(bad)


class _Step:
    """A layer's step for one micro-batch, as ``MicroBatchQueue`` sees it: held on the device or not."""

    def __init__(self):
        self.held = False

    def hold(self, device):
        self.held = True

    def release(self):
        self.held = False


@pytest.mark.parametrize("checkpointed", [(True, True, True, True), (False,) * 4, (True, False, True, False)],
                         ids=["all", "none", "partial"])
def test_the_queue_replays_the_recomputed_microbatch_and_holds_only_those_it_needs(checkpointed):
    """Stage 0 of a 2-stage 1F1B schedule (F0 F1 B0 F2 B1 F3 B2 B3) through Megatron's activation checkpoint: each
    recompute pass gets the micro-batch it recomputes (the forwards not checkpointed are skipped), and a layer holds
    on the device only the current micro-batch's records."""
    from megatron.core import tensor_parallel

    from megatron_trace.megatron.microbatch import MicroBatchQueue

    steps = [_Step() for _ in range(N)]
    seen = []
    q = MicroBatchQueue(0, steps, torch.nn.Module())

    def layer(x):
        seen.append(steps.index(q.select()))
        return x * 2

    outs = {}

    def forward(i):
        x = torch.ones(2, requires_grad=True)
        outs[i] = tensor_parallel.checkpoint(layer, False, x) if checkpointed[i] else layer(x)
        assert seen[-1] == i

    def backward(i):
        n = len(seen)
        outs.pop(i).sum().backward()
        assert seen[n:] == ([i] if checkpointed[i] else [])  # the recompute pass replays micro-batch i
        assert steps[seen[-1]].held and sum(s.held for s in steps) == 1

    for op, i in [(forward, 0), (forward, 1), (backward, 0), (forward, 2), (backward, 1), (forward, 3),
                  (backward, 2), (backward, 3)]:
        op(i)
    assert q.forwards == N and seen[:2] == [0, 1]



def test_two_microbatches_hold_each_in_turn():
    """The smallest queue that moves records: with two micro-batches each forward holds its own step's records (on
    the GPU) and releases the other's."""
    from megatron_trace.megatron.microbatch import MicroBatchQueue

    steps = [_Step(), _Step()]
    q = MicroBatchQueue(0, steps, torch.nn.Module())
    for i in range(2):
        assert q.select() is steps[i] and [s.held for s in steps] == [j == i for j in range(2)]

@pytest.mark.parametrize("kind", ["selective_moe", "full"])
def test_a_recompute_away_from_its_forwards_context_raises(rollout, kind):
    """A recompute pass replays the forward of its own context. Run outside it, it would route and round on its
    own (83 of 87 gradients differed from the context's); in another context, even of one micro-batch, it would
    round toward that context's guidance. Both raise; a forward outside any context clears the mark."""
    micro, guidance = rollout
    tokens, pos, mask, labels = micro[0]
    model = _model(**RECOMPUTE[kind])
    step = _steps(guidance[:1], FallbackCounter())[0]
    for backward_in in (None, step, _steps(guidance[1:2], FallbackCounter())[0]):
        with trace_guidance(model, step):
            loss = model(tokens, pos, mask, labels=labels).float().mean()
        with pytest.raises(RuntimeError, match="outside the context" if backward_in is None else
                           r"no checkpointed forward of this trace_guidance context left to replay \(1 micro"):
            if backward_in is None:
                loss.backward()
            else:
                with trace_guidance(model, backward_in):
                    loss.backward()
        model.zero_grad(set_to_none=True)
    model(tokens, pos, mask, labels=labels).float().mean().backward()  # (no context: clears the mark)
    g_plain = _grads(model)
    model.zero_grad(set_to_none=True)
    with trace_guidance(model, None):
        model(tokens, pos, mask, labels=labels).float().mean().backward()
    assert all(torch.equal(g_plain[n], v) for n, v in _grads(model).items())


def test_a_forward_only_context_leaves_no_mark(rollout):
    """A forward-only run through checkpoints under no_grad (its recompute never comes) does not make the next
    unguided training step's recompute raise."""
    micro, guidance = rollout
    tokens, pos, mask, labels = micro[0]
    model = _model(**RECOMPUTE["selective_moe"])
    with torch.no_grad(), trace_guidance(model, _steps(guidance[:1], FallbackCounter())[0]):
        model(tokens, pos, mask)
    with trace_guidance(model, _steps(guidance[:1], FallbackCounter())[0]):
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
    assert not any("_trace_unreplayed" in vars(m) for m in model.modules())


def test_guidance_refuses_the_expert_parallel_overlap_schedule(rollout):
    """``overlap_moe_expert_parallel_comm`` (EP > 1 only; set here after the config's checks) runs the MoE layer in
    pieces on their own streams: guidance rows are refused there, plain QAT steps (no context) are not."""
    _, guidance = rollout
    model = _model()
    for layer in model.decoder.layers:
        layer.mlp.config.overlap_moe_expert_parallel_comm = True
    with pytest.raises(ValueError, match="not supported with overlap_moe_expert_parallel_comm=True"):
        with trace_guidance(model, _steps(guidance[:1], FallbackCounter())):
            pass
    tokens, pos, mask, _ = batch()
    with torch.no_grad():
        assert torch.isfinite(model(tokens, pos, mask)).all()


def test_megatrons_replay_list_does_not_grow_over_the_microbatches(rollout):
    """The recompute passes replay from the step (REPLAY_FORWARD): Megatron's backward list, which its
    ``set_target_indices`` appends to, would otherwise keep every router call's indices until the context exits."""
    micro, guidance = rollout
    model = _model(**RECOMPUTE["full"])
    with trace_guidance(model, _steps(guidance, FallbackCounter())):
        _schedule(model, micro)
        assert [len(layer.mlp.router.router_replay.replay_backward_list) for layer in model.decoder.layers] == [0] * 4


def test_an_error_inside_a_checkpoint_does_not_leak_into_the_next_step(rollout):
    """A ``fallback='fail'`` error raised inside the MoE layer's activation checkpoint leaves Megatron's checkpointing
    flag set (its first pass clears it only on success); the context clears it, so the next step's forwards are
    forwards, not recompute passes, and count as in a fresh model."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    from megatron_trace.megatron import GuidanceFallbackError

    micro, guidance = rollout
    model = _model(**RECOMPUTE["selective_moe"])
    (g, m), (tokens, pos, mask, labels) = guidance[1], micro[1]
    bad = StepGuidance(sites={k: v for k, v in g.sites.items() if k != (2, "expert_fc1_in")}, routing=g.routing,
                       token_mask=m, fallback="fail")
    with pytest.raises(GuidanceFallbackError, match="layer 2 site 'expert_fc1_in'"):
        with trace_guidance(model, bad):
            model(tokens, pos, mask, labels=labels).float().mean().backward()
    assert not is_checkpointing()
    model.zero_grad(set_to_none=True)
    g0, r0, s0, _ = _per_microbatch(_model(), micro, guidance)
    g1, r1, s1, _ = _one_context(model, micro, guidance)
    assert s1 == s0 and all(torch.equal(g1[n], g0[n]) for n in g0)


def test_coverage_and_counters_of_the_context_and_of_each_microbatch(rollout):
    """``min_coverage`` is checked over the context's rows (all its micro-batches), ``h.coverage()`` is those rows',
    and ``h.microbatch(i).counter`` holds micro-batch i's rows only (``h.counter``: the shared counter)."""
    from megatron_trace.megatron import GuidanceCoverageError

    micro, guidance = rollout
    model = _model()
    stripped = [(type(g)(sites={}, routing=g.routing), m) if i == 1 else (g, m) for i, (g, m) in enumerate(guidance)]
    counter = FallbackCounter()
    with trace_guidance(model, _steps(stripped, counter)) as h:
        _schedule(model, micro)
    cov = h.coverage()
    assert 0 < cov < 1 and h.counter is counter and counter.coverage == cov
    parts = [h.microbatch(i).counter for i in range(N)]
    assert parts[1].used == 0 and sum(p.used for p in parts) == counter.used
    assert [h.microbatch(i).coverage() for i in range(N)][1] == 0.0
    steps = _steps(stripped, FallbackCounter())
    steps[0].min_coverage = (cov + 1) / 2  # micro-batch 1's missing rows pull the step below it
    with pytest.raises(GuidanceCoverageError, match=f"guidance coverage {cov:.4f} at guided sites is below"):
        with trace_guidance(model, steps):
            _schedule(model, micro)
    steps[0].min_coverage = cov  # the whole step's coverage, not micro-batch 1's (0.0)
    with trace_guidance(model, steps):
        _schedule(model, micro)
    steps = _steps(stripped, FallbackCounter())
    steps[0].min_coverage, steps[-1].min_coverage = 0.0, (cov + 1) / 2  # the strictest micro-batch's value holds
    with pytest.raises(GuidanceCoverageError, match=f"below min_coverage={(cov + 1) / 2}"):
        with trace_guidance(model, steps):
            _schedule(model, micro)


def test_a_microbatch_given_no_routing_routes_itself(rollout):
    """Micro-batch 0 replays its rollout's routing, the others are given none: they route themselves, as in a
    context where no micro-batch replays (no replay left over from the micro-batch before)."""
    micro, guidance = rollout
    model = _model()

    def outputs(steps):
        seen = []

        def fwd(data_iterator, m):
            tokens, pos, mask, labels = next(data_iterator)
            out = m(tokens, pos, mask, labels=labels)
            seen.append(out.detach().clone())
            return out, lambda o: (o.float().mean(), {})

        with trace_guidance(model, steps), torch.no_grad():
            get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter(micro), model=[model],
                                        num_microbatches=N, seq_length=SEQ, micro_batch_size=2, forward_only=True)
        return seen

    own = outputs([StepGuidance() for _ in range(N)])
    mixed = outputs([StepGuidance(routing=guidance[0][0].routing)] + [StepGuidance() for _ in range(N - 1)])
    assert not torch.equal(mixed[0], own[0])  # replayed: the rollout model routes some tokens elsewhere
    for i in range(1, N):
        assert torch.equal(mixed[i], own[i]), i


@pytest.mark.parametrize("recompute, train", [
    (RECOMPUTE["selective_core_attn"], True),  # (only the KV sites' core attention is recomputed)
    (dict(RECOMPUTE["selective_moe"], recompute_modules=["moe", "shared_experts"],
          moe_shared_expert_intermediate_size=64), True),
    (RECOMPUTE["selective_moe"], False),  # (the MoE layer's checkpoint runs in eval mode too)
], ids=["core_attn", "moe_shared_experts", "moe_eval"])
def test_a_recompute_outside_the_context_raises_at_its_last_layer_and_leaves_the_flag_clear(rollout, recompute,
                                                                                            train):
    """The out-of-context check covers the KV site's recompute pass (no MoE layer recomputed), a MoE layer whose
    nested shared-experts checkpoint cleared Megatron's flag before the experts run, and a model in eval mode; it
    names the last layer (the backward's first recompute) and leaves the flag clear: the next step's gradients
    equal a fresh model's."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    micro, guidance = rollout
    tokens, pos, mask, labels = micro[0]
    model, want = _model(**recompute).train(train), _model(**recompute).train(train)
    with trace_guidance(model, _steps(guidance[:1], FallbackCounter())[0]):
        loss = model(tokens, pos, mask, labels=labels).float().mean()
    with pytest.raises(RuntimeError, match="^layer 3: the backward recomputes a forward that ran inside trace_guid"):
        loss.backward()
    assert not is_checkpointing()
    model.zero_grad(set_to_none=True)
    for m in (model, want):
        with trace_guidance(m, _steps(guidance[:1], FallbackCounter())[0]):
            m(tokens, pos, mask, labels=labels).float().mean().backward()
    g0, g1 = _grads(want), _grads(model)
    assert g1.keys() == g0.keys() and all(torch.equal(g1[n], g0[n]) for n in g0)


def test_only_forwards_left_unrecomputed_mark_their_modules(rollout):
    """A context whose checkpointed forwards were all recomputed leaves no mark: the recompute of a forward that
    ran before it, outside any context, is not refused and gives the plain gradients."""
    micro, guidance = rollout
    tokens, pos, mask, labels = micro[0]
    model = _model(**RECOMPUTE["selective_moe"])
    model(tokens, pos, mask, labels=labels).float().mean().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, pos, mask, labels=labels).float().mean()  # (no context; its recompute comes later)
    with trace_guidance(model, _steps(guidance[1:2], FallbackCounter())[0]):
        model(*micro[1][:3], labels=micro[1][3]).float().mean().backward()
    assert not any("_trace_unreplayed" in vars(m) for m in model.modules())
    model.zero_grad(set_to_none=True)
    loss.backward()
    got = _grads(model)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
