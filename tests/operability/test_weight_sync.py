"""Issue 11 item 8: bucketed weight sync with a size knob and a per-sync time; a failing or too slow stream
raises a clear error and leaves the rollout on its previous complete weights (never half-updated)."""

import pytest
import torch

from megatron_trace.bridge.sync import (
    WeightBucket,
    WeightSyncError,
    WeightSyncTimeoutError,
    iter_buckets,
    make_stream,
    sync_weights,
    value_nbytes,
)
from megatron_trace.config import TraceConfig
from megatron_trace.rollout import HFRolloutBackend
from megatron_trace.rollout.hf_weights import checkpoint_tensors

from ..rollout._tiny import tiny_model

WQ = TraceConfig().weight_quantizer()


def _rollout():
    return HFRolloutBackend(tiny_model(seed=0), mode="fp4", dtype=torch.float32)


def _new_weights():
    return list(checkpoint_tensors(tiny_model(seed=1)))


def _snapshot(be):
    store = {k: (q.codes.clone(), q.block_scales.view(torch.uint8).clone(), q.global_amax.clone())
             for k, q in be.weight_store._w.items()}
    return {k: v.clone() for k, v in be.model.state_dict().items()}, store, be.policy_version


def _assert_unchanged(be, snap):
    state, store, version = snap
    now = be.model.state_dict()
    assert all(torch.equal(state[k], now[k]) for k in state)
    for k, (codes, scales, amax) in store.items():
        q = be.weight_store._w[k]
        assert torch.equal(q.codes, codes) and torch.equal(q.block_scales.view(torch.uint8), scales)
        assert torch.equal(q.global_amax, amax)
    assert be.policy_version == version


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_buckets_respect_the_knob_and_give_the_same_weights(fmt):
    weights = _new_weights()
    one, many = _rollout(), _rollout()
    s1 = sync_weights(one, weights, fmt=fmt, quantizer=WQ, dtype=torch.float32, version=1)
    bucket = 64 << 10
    sizes = [value_nbytes(v) for _, v in make_stream(weights, fmt, WQ, torch.float32)]
    s2 = sync_weights(many, weights, fmt=fmt, quantizer=WQ, dtype=torch.float32, version=1, bucket_bytes=bucket)
    want, size = 0, 0  # buckets of an independent greedy count
    for n in sizes:
        if size and size + n > bucket:
            want, size = want + 1, 0
        size += n
    assert (s1.buckets, s2.buckets) == (1, want + 1) and s2.buckets > 3
    assert s2.as_dict()[f"sync/{fmt}/seconds"] >= 0.0 and s2.bytes_total == s1.bytes_total
    a, b = one.model.state_dict(), many.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for k, q in one.weight_store._w.items():
        assert torch.equal(q.codes, many.weight_store._w[k].codes)


def test_bucket_round_trip_is_bit_exact():
    items = list(make_stream(_new_weights()[:40], "fp4", WQ, torch.float32))
    buckets = [WeightBucket.pack(b) for b in iter_buckets(items, 10_000)]
    back = [v for b in buckets for v in b.values()]
    assert [n for n, _ in back] == [n for n, _ in items]
    for (_, x), (_, y) in zip(items, back):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert torch.equal(x.codes, y.codes) and torch.equal(x.global_amax, y.global_amax)
            assert torch.equal(x.block_scales.view(torch.uint8), y.block_scales.view(torch.uint8))


def _failing(weights, after: int):
    for i, item in enumerate(weights):
        if i == after:
            raise ConnectionError("trainer rank 3 went away")
        yield item


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_interrupted_stream_leaves_the_previous_weights(fmt):
    be = _rollout()
    snap = _snapshot(be)
    weights = _new_weights()
    with pytest.raises(WeightSyncError, match=r"after \d+ tensors .* keeps its previous weights \(version 0\).*"
                                              r"trainer rank 3 went away"):
        sync_weights(be, _failing(weights, len(weights) // 2), fmt=fmt, quantizer=WQ, dtype=torch.float32,
                     bucket_bytes=32 << 10)
    _assert_unchanged(be, snap)


class Clock:
    """The test's time: it advances as the tensors arrive (``arriving``), not per reading (no wall time in the test)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def arriving(self, weights, seconds: float = 1.0):
        """``weights``, each taking ``seconds`` to arrive (an export's gather)."""
        for item in weights:
            self.t += seconds
            yield item


def test_timeout_fails_clearly_and_applies_nothing():
    be = _rollout()
    snap = _snapshot(be)
    clock = Clock()
    with pytest.raises(WeightSyncTimeoutError, match=r"exceeded timeout_s=5 after \d+ tensors"):
        sync_weights(be, clock.arriving(_new_weights()), fmt="fp4", quantizer=WQ, dtype=torch.float32,
                     bucket_bytes=32 << 10, timeout_s=5, clock=clock)
    _assert_unchanged(be, snap)
    n = len(_new_weights())
    clock = Clock()
    stats = sync_weights(be, clock.arriving(_new_weights()), fmt="fp4", quantizer=WQ, dtype=torch.float32,
                         timeout_s=n + 1, clock=clock)  # one bucket: within the budget
    assert stats.seconds == n and be.policy_version == 1


def test_the_deadline_is_checked_between_tensors_within_one_bucket():
    """The whole model in one bucket (the default 512 MB): the deadline was checked between buckets only, so a
    stream of 1 s a tensor with timeout_s=5 was read to its end (every tensor, n s) before the timeout, which then
    said "after 0 tensors"; it stops at the tensor that crossed the deadline."""
    be = _rollout()
    snap = _snapshot(be)
    clock = Clock()
    with pytest.raises(WeightSyncTimeoutError, match=r"exceeded timeout_s=5 after 6 tensors \(.*0 bucket\(s\)"):
        sync_weights(be, clock.arriving(_new_weights()), fmt="bf16", timeout_s=5, clock=clock)
    assert clock.t == 6 < len(_new_weights())
    _assert_unchanged(be, snap)


def test_sync_errors_are_importable_beside_sync_weights():
    """README names the errors of ``sync_weights`` and ``check_finite``: a caller imports them from the package it
    imports the function from."""
    import megatron_trace.bridge as bridge
    from megatron_trace.formats import NonFiniteError

    assert bridge.WeightSyncError is WeightSyncError and bridge.WeightSyncTimeoutError is WeightSyncTimeoutError
    assert {"WeightSyncError", "WeightSyncTimeoutError"} <= set(bridge.__all__)
    megatron = pytest.importorskip("megatron_trace.megatron", reason="megatron-core")
    assert megatron.NonFiniteError is NonFiniteError and "NonFiniteError" in megatron.__all__


def test_a_sync_that_takes_exactly_timeout_s_applies_and_the_knobs_are_checked_first():
    """``timeout_s`` bounds the time (a sync of exactly ``timeout_s`` seconds applies); a ``timeout_s`` that is not > 0
    or a ``bucket_bytes`` that is not an int >= 1 is refused by name before the stream is read."""
    be = _rollout()
    n = len(_new_weights())
    clock = Clock()
    stats = sync_weights(be, clock.arriving(_new_weights()), fmt="bf16", dtype=torch.float32, timeout_s=n,
                         clock=clock)
    assert stats.seconds == n and be.policy_version == 1
    read = []

    def stream():
        for item in _new_weights():
            read.append(item)
            yield item

    for bad in (0, -1.0, float("nan"), True, "5"):  # (True would be 1 s; a string failed with a bare TypeError)
        with pytest.raises(ValueError, match=rf"timeout_s={bad!r} must be a number of seconds > 0"):
            sync_weights(be, stream(), timeout_s=bad)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=rf"bucket_bytes={bad!r} must be an int >= 1"):
            sync_weights(be, stream(), bucket_bytes=bad)
    assert read == [] and be.policy_version == 1


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_sync_weights_hands_the_recipe_to_the_rollout(fmt):
    """``recipe`` reaches ``update_weights``: a recipe of another version is refused with nothing applied, the right
    one becomes the rollout's recipe."""
    from megatron_trace.manifest import RecipeMismatchError

    from .test_recipe_check import CFG, _backend, trainer_recipe

    be = _backend(recipe=trainer_recipe())
    snap = _snapshot(be)
    kw = dict(fmt=fmt, quantizer=CFG.weight_quantizer(), dtype=torch.float32, version=1)
    with pytest.raises(RecipeMismatchError, match="weight_version: trainer=5 hf rollout=1"):
        sync_weights(be, _new_weights(), recipe=trainer_recipe(version=5), **kw)
    _assert_unchanged(be, snap)
    sync_weights(be, _new_weights(), recipe=trainer_recipe(version=1), **kw)
    assert be.policy_version == 1 and be.recipe() == trainer_recipe(version=1)


def test_buckets_fill_up_to_exactly_bucket_bytes():
    """A bucket takes tensors while their wire bytes stay <= ``bucket_bytes`` (one that fills it exactly included); a
    tensor larger than a bucket travels alone; order and count are kept."""
    t = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate((4, 4, 4, 9, 1, 3))]
    got = [[n for n, _ in b] for b in iter_buckets(t, 8)]
    assert got == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [[n for n, _ in b] for b in iter_buckets(t, 1 << 20)] == [[n for n, _ in t]]


@pytest.mark.parametrize("edit, match", [
    (lambda q: dict(codes=q.codes[:1]), r"its payload torch.uint8 \(1, 16\) != torch.uint8 \(64, 16\)"),
    (lambda q: dict(codes=q.codes[:, :-1]), r"its payload torch.uint8 \(64, 15\) != torch.uint8 \(64, 16\)"),
    (lambda q: dict(block_scales=q.block_scales[:1]), r"its block_scales shape \(1, 2\) != \(64, 2\)"),
    (lambda q: dict(global_amax=q.global_amax.reshape(1).repeat(2)), r"global_amax shape \(2,\) must be \[\]"),
    (lambda q: dict(global_amax=None), "NVFP4 needs a float32 global_amax tensor, got NoneType"),
], ids=["codes-one-row", "codes-short-k", "scales-one-row", "amax-two", "amax-none"])
def test_fp4_values_whose_codes_scales_or_amax_do_not_fit_their_shape_are_refused_before_any_copy(edit, match):
    """An FP4 expert weight whose declared ``shape`` is right but whose codes / block scales / amax are not of it: a
    single row of codes or scales broadcast over every row of the parameter and was stored (silently other weights),
    an NVFP4 value without its amax failed while applying, after the other tensors were copied. Refused by name, with
    nothing changed; the same update with the right value then applies."""
    import dataclasses

    be = _rollout()
    snap = _snapshot(be)
    good = list(make_stream(_new_weights(), "fp4", WQ, torch.float32))
    name = "model.layers.2.mlp.experts.7.down_proj.weight"  # the last expert: every other tensor checked before it
    bad = [(n, dataclasses.replace(v, **edit(v)) if n == name else v) for n, v in good]
    with pytest.raises(ValueError, match=rf"FP4 weight for layer 2 expert 7 fc2: .*{match}"):
        be.update_weights(bad, version=1)
    _assert_unchanged(be, snap)
    be.update_weights(good, version=1)
    q, want = be.weight_store._w[(2, 7, "fc2")], dict(good)[name]
    assert torch.equal(q.codes, want.codes) and torch.equal(q.global_amax, want.global_amax)
