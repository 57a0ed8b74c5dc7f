"""The local experts' weights of one linear as one [E, M, K] tensor without a copy.

The torch experts (``TraceSequentialMLP``) run one grouped GEMM over all local experts, which needs their weights
stacked. ``torch.stack`` copies them on every forward: for 128 Qwen3-30B-A3B experts, 1.2 GB per layer read and
written, a 128-input ``cat`` launch (about 0.35 ms of host time), and in BF16 the copy is kept for the backward.
``pack`` instead places the weights of each linear side by side in one buffer once (the parameters become views
of it, with their values); ``stacked`` then returns the buffer as [E, M, K] with a gradient to each weight.

``stacked`` checks the layout on every call: where something re-seated a weight (``param.data = ...``, a module
``.to()`` that copies, Megatron's distributed optimizer placing parameters in its own buffers), or the weights
are not evenly spaced views of one storage, it falls back to ``torch.stack`` (same values and gradients).
"""

from __future__ import annotations

from operator import attrgetter

import torch

_SHAPE, _DTYPE, _PRE_HOOKS = attrgetter("shape"), attrgetter("dtype"), attrgetter("_forward_pre_hooks")

VIEWS = True
"""False: ``stacked`` always copies with ``torch.stack`` (the path before packing; ``bench_qat_step --stack-copy``)."""


class _StackGradient(torch.autograd.Function):
    """``value`` [E, ...] in the forward; in the backward, slice e of its gradient to ``weights[e]`` (the gradient
    ``torch.stack(weights)`` has)."""

    @staticmethod
    def forward(ctx, value, *weights):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.unbind(0))


def with_stack_gradient(value: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """``value`` (a stack of ``weights``, or a function of it with an identity gradient) with the gradient of
    ``torch.stack(weights)`` to each weight; ``value``'s own history is not followed."""
    return _StackGradient.apply(value, *weights)


def of(experts, name: str, *, pre_hooks: bool = False) -> list[torch.Tensor]:
    """The ``weight`` of submodule ``name`` of each module in ``experts`` (e.g. a ``SequentialMLP``'s
    ``local_experts`` and ``"linear_fc1"``), read from the modules' registries: on every forward, that is 4.5-6x
    less host time than two ``nn.Module.__getattr__`` calls per expert. A submodule or weight that is not
    registered there (a parametrized linear) is read with ``getattr``.

    ``pre_hooks``: first run those submodules' forward pre-hooks, as calling them would. The torch experts read
    their linears' weights for one grouped GEMM and never call the linears, so hooks that must run before a
    module's parameters are used would not run. Megatron's DDP with the distributed optimizer and
    ``overlap_param_gather`` is one: each module's pre-hook waits for (and starts) the all-gather of its
    parameters' bucket; without it the experts would read shards that other ranks updated but never sent. The
    hooks get no inputs (``()``, and ``{}`` for hooks registered ``with_kwargs``); what they return is not used.
    Global hooks (``register_module_forward_pre_hook``) are not run. With no hook registered this costs one check
    per expert."""
    try:
        modules = [e._modules[name] for e in experts]
    except KeyError:
        modules = [getattr(e, name) for e in experts]
    if pre_hooks and any(map(_PRE_HOOKS, modules)):
        for m in modules:
            with_kwargs = m._forward_pre_hooks_with_kwargs
            for hook_id, hook in list(m._forward_pre_hooks.items()):
                if hook_id in with_kwargs:
                    hook(m, (), {})
                else:
                    hook(m, ())
    try:
        return [m._parameters["weight"] for m in modules]
    except KeyError:
        return [m.weight for m in modules]


def pack(weights: list[torch.nn.Parameter]) -> None:
    """Move the values of same-shape parameters into one new [E, *shape] buffer and make each parameter a view
    of its slice (no-op for fewer than two)."""
    if len(weights) < 2:
        return
    w0 = weights[0]
    if any(w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device for w in weights):
        raise ValueError("pack needs parameters of one shape, dtype and device, got "
                         f"{sorted({(tuple(w.shape), str(w.dtype), str(w.device)) for w in weights})}")
    buf = torch.empty((len(weights), *w0.shape), dtype=w0.dtype, device=w0.device)
    with torch.no_grad():
        for i, w in enumerate(weights):
            buf[i].copy_(w)
            w.data = buf[i]


def _storage_view(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The [E, *shape] tensor over the weights' common storage when they are contiguous, of one shape and dtype,
    and evenly spaced in order inside the first one's storage (weight i at o + i * step, step >= numel); else
    None. (This runs on every forward: each check is one ``map`` over the weights, without a Python frame per
    weight.)"""
    w0, n = weights[0], len(weights)
    if not w0.is_contiguous() or w0.device.type == "meta" or w0.numel() == 0:
        return None
    shape, dtype, ptr0, size = w0.shape, w0.dtype, w0.data_ptr(), w0.element_size()
    step = (weights[1].data_ptr() - ptr0) // size if n > 1 else w0.numel()
    if step < w0.numel() or list(map(torch.Tensor.data_ptr, weights)) != list(range(ptr0, ptr0 + n * step * size,
                                                                                      step * size)):
        return None
    if (list(map(_SHAPE, weights)) != [shape] * n or list(map(_DTYPE, weights)) != [dtype] * n
            or not all(map(torch.Tensor.is_contiguous, weights))):
        return None
    storage, base = w0.untyped_storage(), w0.storage_offset()
    if (base + (n - 1) * step + w0.numel()) * size > storage.nbytes():
        return None  # (not one allocation: the last weight lies past the first's storage)
    view = torch.empty(0, dtype=dtype, device=w0.device)
    return view.set_(storage, base, (n, *shape), (step, *w0.stride()))


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(weights)``: the same values and gradients, without a copy where ``pack`` laid them out (the
    result then shares the weights' storage: read it, never write into it)."""
    view = _storage_view(weights) if weights and VIEWS else None
    if view is None:
        return torch.stack(weights)
    if not torch.is_grad_enabled() or not any(w.requires_grad for w in weights):
        return view
    return with_stack_gradient(view, weights)
