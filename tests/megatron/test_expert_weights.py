"""``expert_weights``: the local experts' weights packed side by side give [E, M, K] without a copy, with the
values and gradients of ``torch.stack``; anything else falls back to the stack."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import expert_weights, trace_spec

from .harness import EXPERTS, batch, build_model, stock_spec, tiny_config


def _params(n=4, shape=(6, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for _ in range(n)]


def _grads(weights, how):
    for w in weights:
        w.grad = None
    upstream = torch.arange(len(weights) * weights[0].numel(), dtype=torch.float32).reshape(len(weights), -1)
    (how(weights).reshape(len(weights), -1) * upstream).sum().backward()
    return [w.grad.clone() for w in weights]


def test_packed_weights_stack_without_a_copy_with_the_stacks_values_and_gradients():
    weights = _params()
    want_values = torch.stack([w.detach().clone() for w in weights])
    want_grads = _grads(weights, torch.stack)
    expert_weights.pack(weights)
    got = expert_weights.stacked(weights)
    assert got.data_ptr() == weights[0].data_ptr() and got.untyped_storage().data_ptr() == \
        weights[-1].untyped_storage().data_ptr()  # the parameters' own storage: no copy
    assert torch.equal(got, want_values)
    assert [torch.equal(a, b) for a, b in zip(_grads(weights, expert_weights.stacked), want_grads)] == [True] * 4
    with torch.no_grad():  # an optimizer's in-place update is what the next forward sees
        weights[2].add_(1.0)
    assert torch.equal(expert_weights.stacked(weights)[2], want_values[2] + 1.0)


def test_re_seated_or_unpacked_weights_fall_back_to_the_stack():
    weights = _params()
    expert_weights.pack(weights)
    weights[1].data = weights[1].data.clone()  # e.g. a module .to() that copies, or another buffer layout
    got = expert_weights.stacked(weights)
    assert got.data_ptr() != weights[0].data_ptr()
    assert torch.equal(got, torch.stack([w.detach() for w in weights]))
    loose = _params(seed=1)
    assert torch.equal(expert_weights.stacked(loose), torch.stack([w.detach() for w in loose]))
    view = expert_weights.stacked(list(torch.randn(3, 4, 5).unbind(0)))  # evenly spaced views: no copy needed
    assert view.shape == (3, 4, 5)


@pytest.mark.parametrize("reseat", ["transposed", "reshaped", "other dtype", "empty"])
def test_weights_at_the_packed_addresses_but_another_layout_fall_back_to_the_stack(reseat):
    weights = _params()
    expert_weights.pack(weights)
    w = weights[3]
    if reseat == "transposed":  # same address, not contiguous
        w.data = w.data.t()
    elif reseat == "reshaped":  # same address and size, another shape
        w.data = w.data.reshape(8, 6)
    elif reseat == "other dtype":  # same address and shape, another dtype of the same size
        w.requires_grad_(False)
        w.data = w.data.view(torch.int32)
    else:
        for p in weights:
            p.data = p.data[:0]
    if reseat in ("reshaped", "transposed"):
        with pytest.raises(RuntimeError):  # torch.stack itself refuses: the view must not hide it
            expert_weights.stacked(weights)
        assert expert_weights._storage_view(weights) is None
    elif reseat == "other dtype":
        assert expert_weights._storage_view(weights) is None
        assert torch.equal(expert_weights.stacked(weights), torch.stack(weights))
    else:
        assert expert_weights.stacked(weights).shape == (4, 0, 8)


class _Expert(torch.nn.Module):
    def __init__(self, parametrized=False):
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(3, 2, bias=False)
        if parametrized:  # the weight becomes a property of a generated class, not a registered parameter
            torch.nn.utils.parametrize.register_parametrization(self.linear_fc1, "weight", torch.nn.Identity())


@pytest.mark.parametrize("parametrized", [False, True])
def test_of_reads_the_weights_getattr_reads(parametrized):
    experts = torch.nn.ModuleList(_Expert(parametrized) for _ in range(3))
    want = [e.linear_fc1.weight for e in experts]
    got = expert_weights.of(experts, "linear_fc1")
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    if not parametrized:
        assert all(a is b for a, b in zip(got, want))


def test_pack_rejects_mixed_shapes():
    with pytest.raises(ValueError, match=r"one shape, dtype and device.*\(6, 8\).*\(6, 9\)"):
        expert_weights.pack(_params(2) + _params(1, shape=(6, 9)))


@pytest.mark.usefixtures("world1")
def test_the_torch_experts_are_packed_and_a_checkpoint_load_keeps_it():
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig()))
    experts = model.decoder.layers[0].mlp.experts
    for name in ("linear_fc1", "linear_fc2"):
        weights = expert_weights.of(experts.local_experts, name)
        assert len(weights) == EXPERTS
        assert all(a is getattr(e, name).weight for a, e in zip(weights, experts.local_experts))
        assert expert_weights.stacked(weights).data_ptr() == weights[0].data_ptr()
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and v.is_floating_point()}
    model.load_state_dict(state, strict=False)  # copies in place
    weights = [e.linear_fc1.weight for e in experts.local_experts]
    got = expert_weights.stacked(weights)
    assert got.data_ptr() == weights[0].data_ptr()
    assert torch.equal(got, torch.stack([state[f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight"]
                                         for i in range(EXPERTS)]))
    tokens, pos, mask, _ = batch()
    model(tokens, pos, mask).float().sum().backward()  # gradients reach every expert's weight
    assert all(w.grad is not None or getattr(w, "main_grad", None) is not None for w in weights)


def test_of_with_pre_hooks_runs_each_linears_hooks_as_a_call_would_without_inputs():
    experts = torch.nn.ModuleList(_Expert(False) for _ in range(3))
    calls = []
    for i, e in enumerate(experts):
        e.linear_fc1.register_forward_pre_hook(lambda m, args, i=i: calls.append(("plain", i, m, args)))
        e.linear_fc1.register_forward_pre_hook(lambda m, args, kwargs, i=i: calls.append(("kw", i, m, args, kwargs)),
                                               with_kwargs=True)
    experts[0].register_forward_pre_hook(lambda m, args: calls.append(("expert", m)))  # not the linear: not run
    for e in experts:
        e.linear_fc2 = torch.nn.Linear(2, 3, bias=False)
    expert_weights.of(experts, "linear_fc1")
    expert_weights.of(experts, "linear_fc2", pre_hooks=True)
    assert calls == []  # not asked for; no hook on linear_fc2
    got = expert_weights.of(experts, "linear_fc1", pre_hooks=True)
    assert all(a is e.linear_fc1.weight for a, e in zip(got, experts))
    want = []
    for i, e in enumerate(experts):
        want += [("plain", i, e.linear_fc1, ()), ("kw", i, e.linear_fc1, (), {})]
    assert calls == want


def test_one_weight_given_twice_stacks_it_twice_with_both_gradients():
    """Evenly spaced with a step of 0 (the same storage offset): not a layout one view can give without overlap."""
    w = _params(n=1)[0]
    want = torch.stack([w.detach(), w.detach()])
    assert torch.equal(expert_weights.stacked([w, w]), want)
    grad = _grads([w, w], expert_weights.stacked)[0]  # (one parameter: the gradients of both slices summed)
    upstream = torch.arange(2 * w.numel(), dtype=torch.float32).reshape(2, *w.shape)
    assert torch.equal(grad, upstream[0] + upstream[1])


def test_weights_of_adjacent_separate_storages_fall_back_to_the_stack():
    """Weights at evenly spaced adjacent addresses, each in a storage of its own (two allocations that happen to be
    consecutive): a view over the first one's storage would reach past its end."""
    base = torch.randn(3, 6, 8)
    whole, nbytes = base.untyped_storage(), 6 * 8 * base.element_size()
    weights = [torch.nn.Parameter(torch.empty(0).set_(whole[i * nbytes:(i + 1) * nbytes], 0, (6, 8)))
               for i in range(3)]
    assert [w.untyped_storage().nbytes() for w in weights] == [nbytes] * 3
    assert torch.equal(expert_weights.stacked(weights), base)
    want = _grads(weights, torch.stack)
    assert [torch.equal(a, b) for a, b in zip(_grads(weights, expert_weights.stacked), want)] == [True] * 3


def test_of_with_pre_hooks_runs_the_hooks_of_an_expert_whose_first_neighbour_has_none():
    """Only expert 2's linear has a pre-hook (e.g. it alone in a bucket of its own): it still runs."""
    experts = torch.nn.ModuleList(_Expert(False) for _ in range(3))
    calls = []
    experts[2].linear_fc1.register_forward_pre_hook(lambda m, args: calls.append(m))
    expert_weights.of(experts, "linear_fc1", pre_hooks=True)
    assert calls == [experts[2].linear_fc1]


def test_pack_rejects_mixed_dtypes_instead_of_converting_the_values():
    weights = _params(2) + [torch.nn.Parameter(torch.randn(6, 8, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"one shape, dtype and device.*float32.*float64"):
        expert_weights.pack(weights)


def test_evenly_spaced_weights_with_gaps_between_them_stack_their_own_values():
    """Weights [6, 8] every 60 elements of one buffer (12 unused between two): the view steps 60, not 48."""
    buf = torch.randn(4, 60)
    weights = [torch.nn.Parameter(torch.empty(0).set_(buf.untyped_storage(), 60 * i, (6, 8))) for i in range(4)]
    want = torch.stack([w.detach().clone() for w in weights])
    got = expert_weights.stacked(weights)
    assert got.data_ptr() == weights[0].data_ptr()  # one view, no copy
    assert torch.equal(got, want)
    assert [torch.equal(a, b) for a, b in zip(_grads(weights, expert_weights.stacked), _grads(weights, torch.stack))] \
        == [True] * 4


def test_a_weight_of_the_same_shape_at_its_packed_address_but_column_major_falls_back_to_the_stack():
    weights = _params()
    expert_weights.pack(weights)
    w = weights[2]
    w.data = torch.as_strided(w.data, (6, 8), (1, 6))  # same address, shape and dtype; not contiguous
    assert expert_weights._storage_view(weights) is None
    assert torch.equal(expert_weights.stacked(weights), torch.stack([p.detach() for p in weights]))
