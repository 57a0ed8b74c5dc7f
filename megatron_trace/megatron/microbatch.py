"""Which micro-batch's guidance a layer's forward uses when one ``trace_guidance`` context spans several
micro-batches (Megatron's ``forward_backward_func`` with ``num_microbatches > 1``, pipeline 1F1B included).

Each layer takes the micro-batches' steps in order: its k-th forward uses step k. Megatron's schedules run every
model chunk's micro-batches in order, forwards and backwards alike, so a layer's k-th forward is micro-batch k
whatever the interleaving across stages. A forward that runs inside an activation checkpoint (its first,
gradient-free pass) is queued, and the recompute passes in the backward take the queued steps in the same order:
micro-batches run without checkpointing (``num_microbatches_with_partial_activation_checkpoints``) are skipped
correctly. The recompute pass is not counted as a forward.

A recompute pass replays a forward of its own context: one with no checkpointed forward left (its forward ran
outside the context, or in another one) raises, whatever the number of micro-batches. A context that ends with
checkpointed forwards not yet recomputed (gradients enabled) marks their modules, and a recompute pass outside any
context is then refused too (``check_replayed``): it would round and route on its own, not as its forward did.

So with activation recompute the backwards must run in the order of their forwards, as Megatron's schedules
run them. One backward through several checkpointed micro-batches (their losses summed) recomputes them in
reverse, and nothing here can tell: each would round toward another micro-batch's records. Enter one context per
micro-batch there.

With several micro-batches a layer holds on the GPU the records of one micro-batch at a time: its step's records
move there (from pinned host memory) as the step is selected, forward or recompute pass, and the device copies are
dropped when the layer moves on, with the step's per-forward data (``MoEStep``'s virtual tokens). The host
records are pinned once, as the queue is built. A micro-batch that is recomputed is copied again then: a
forward-only run through activation checkpoints (whose recompute never comes) holds no more than any other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from .step import clear_checkpointing_flag, in_checkpoint_first_pass, in_recompute


class MicroBatchQueue:
    """The per-micro-batch steps (``MoEStep`` or ``KVStep``) of one layer; ``select`` picks the current one and
    binds it to ``module`` (the module that reads it, as ``module._trace_step``)."""

    def __init__(self, layer: int, steps: Sequence, module, device=None, checkpointed: bool = False):
        """``checkpointed``: the module runs inside an activation checkpoint of its own (``step.in_recompute``)."""
        if not steps:
            raise ValueError("a micro-batch queue needs at least one step")
        self.layer, self.steps, self.module, self.device = layer, list(steps), module, device
        self.checkpointed = checkpointed
        self.forwards = 0  # forwards begun (recompute passes aside)
        self._checkpointed: deque[int] = deque()  # micro-batches whose forward the backward will recompute
        self._index: int | None = None  # the current step's micro-batch (None before the first forward)
        self.current = self.steps[0]
        if len(self.steps) > 1 and device is not None:
            for s in self.steps:  # (after the steps' checks, which may convert a record: full -> compact)
                s.pin()
        self._bind(self.current)

    def _bind(self, step) -> None:
        self.module._trace_step = step

    def select(self):
        """The step of the forward (or recompute pass) that begins now."""
        n = len(self.steps)
        if in_recompute(self.checkpointed):
            if not self._checkpointed:
                raise RuntimeError(
                    f"layer {self.layer}: a recompute pass with no checkpointed forward of this trace_guidance "
                    f"context left to replay ({n} micro-batch(es)): its forward ran outside the context or in "
                    "another one, so its guidance is unknown; run each forward and its backward in one context")
            i = self._checkpointed.popleft()
        else:
            i = self.forwards
            if i >= n:
                raise RuntimeError(_too_many(self.layer, n))
            self.forwards += 1
            if in_checkpoint_first_pass(self.checkpointed):
                self._checkpointed.append(i)
        if n > 1:  # (one micro-batch: its records went to the GPU at the context entry)
            prev = self._index
            if prev is not None and prev != i:
                self.steps[prev].release()
            self.steps[i].hold(self.device)
        self._index = i
        self.current = self.steps[i]
        self._bind(self.current)
        return self.current

    def pre_hook(self, module, args) -> None:
        """Forward pre-hook of the module that reads the steps (the KV site's core attention)."""
        self.select()

    def close(self) -> None:
        """Unbind the step as the context ends. Checkpointed forwards of a run with gradients whose recompute has
        not come mark the module (``check_replayed``)."""
        self._bind(None)
        if self._checkpointed and torch.is_grad_enabled():
            self.module._trace_unreplayed = (self.layer, self.checkpointed)


def check_replayed(module) -> None:
    """For a module outside any trace_guidance context: refuse the recompute pass of a forward that ran inside one
    (``MicroBatchQueue.close``); any other forward clears the mark."""
    mark = module.__dict__.get("_trace_unreplayed")
    if mark is None:
        return
    layer, checkpointed = mark
    if in_recompute(checkpointed):
        clear_checkpointing_flag()  # (set for this recompute pass, which ends here)
        raise RuntimeError(
            f"layer {layer}: the backward recomputes a forward that ran inside trace_guidance, outside the context: "
            "the recompute would round and route on its own, not as that forward did (wrong gradients); run the "
            "backward inside the context")
    del module._trace_unreplayed


def _too_many(layer: int, n: int) -> str:
    if n == 1:
        return (f"layer {layer} ran a second forward inside one trace_guidance context: its guidance and routing "
                "belong to one micro-batch; enter a context per micro-batch, or give the context one StepGuidance "
                "per micro-batch (a list)")
    return (f"layer {layer} ran forward {n + 1} inside one trace_guidance context given guidance for {n} "
            "micro-batches: give one StepGuidance per micro-batch the context runs")


def check_all_ran(queues: Sequence[MicroBatchQueue]) -> None:
    """With guidance for several micro-batches, every layer must have run each of them once (none left unused)."""
    n = len(queues[0].steps) if queues else 1
    short = sorted({q.layer for q in queues if q.forwards != n})
    if n > 1 and short:
        ran = sorted({q.forwards for q in queues if q.forwards != n})
        raise ValueError(f"trace_guidance was given guidance for {n} micro-batches but layers {short} ran {ran} "
                         "forwards: pass one StepGuidance per micro-batch of the forward_backward call")
