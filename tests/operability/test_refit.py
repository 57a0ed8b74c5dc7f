"""Issue 11 item 3: A -> B -> A refit is bit-exact with a fresh load of A, in place, with no stale derived
state; a sentinel compares trainer and rollout log-probs after each sync."""

import dataclasses

import pytest
import torch

from megatron_trace.bridge.sync import fp4_stream, sync_weights
from megatron_trace.config import TraceConfig
from megatron_trace.monitor import SentinelCheck, SentinelError
from megatron_trace.rollout import HFRolloutBackend, SamplingParams
from megatron_trace.rollout.hf_weights import checkpoint_tensors
from megatron_trace.rollout.refit import RefitError, batch_differences, not_applied, refit_self_test

from ..rollout._tiny import tiny_model

CFG = TraceConfig(guided_layers="all", cache_mode="full")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [5, 6, 7]]
SAMPLING = SamplingParams(max_new_tokens=4, seed=3)


def _weights(seed):
    return list(checkpoint_tensors(tiny_model(seed=seed)))


def _make(cls=HFRolloutBackend, seed=9):
    return lambda: cls(tiny_model(seed=seed), mode="fp4", trace_config=CFG, dtype=torch.float32)


def _fresh_a():
    """A backend started from checkpoint A (seed 1): the reference of every refit."""
    return _make(seed=1)()


@pytest.mark.parametrize("wire", ["bf16", "fp4"])
def test_refit_a_b_a_is_bit_exact_in_place_and_fresh(wire):
    a, b = _weights(1), _weights(2)
    if wire == "fp4":  # packed codes from the trainer, as the FP4 sync sends them
        a, b = (list(fp4_stream(w, CFG.weight_quantizer(), torch.float32)) for w in (a, b))
    assert refit_self_test(_make(), a, b, PROMPTS, SAMPLING, fresh_a=_fresh_a())["refit/bit_exact"] == 1.0


class StaleStore(HFRolloutBackend):
    """Reintroduces the verl#7519 bug: refit copies new BF16 weights but keeps the old packed FP4 codes."""

    def _quantize_experts(self, keys):
        if getattr(self, "_started", False):
            return  # the parameters got the new values; the packed store is not rebuilt
        self._started = True
        super()._quantize_experts(keys)


class Reallocating(HFRolloutBackend):
    """Reintroduces the sglang#28676 class of bug: an update that allocates new storage instead of copying."""

    def update_weights(self, weights, **kw):
        super().update_weights(weights, **kw)
        for p in self.model.parameters():
            p.data = p.data.clone()


class Dropping(HFRolloutBackend):
    """An update that skips the attention weights: a reference built through the same update shares the bug."""

    def update_weights(self, weights, **kw):
        super().update_weights([(n, v) for n, v in weights if "self_attn" not in n], **kw)


class DroppingAnExpert(HFRolloutBackend):
    """An update that skips expert 0 of every layer (stored fused in the model): invisible to a reference built
    through the same update, and to a check of the names the model holds."""

    def update_weights(self, weights, **kw):
        super().update_weights([(n, v) for n, v in weights if ".experts.0." not in n], **kw)


@pytest.mark.parametrize("cls, match, fresh", [
    (StaleStore, "derived state weight_store", "startup"),  # (a reference updated to A keeps the same stale store)
    (Reallocating, "data_ptr", "startup"), (Reallocating, "data_ptr", "update"),
    (Dropping, r"update not applied: \d+, e\.g\. \['model\.layers\.0\.self_attn", "startup"),
    (Dropping, r"update not applied: \d+, e\.g\. \['model\.layers\.0\.self_attn", "update"),
    (DroppingAnExpert, r"update not applied: \d+, e\.g\. \['model\.layers\.0\.mlp\.experts\.0\.", "update"),
])
def test_the_self_test_fires_on_reintroduced_refit_bugs(cls, match, fresh):
    with pytest.raises(RefitError, match=match):
        refit_self_test(_make(cls), _weights(1), _weights(2), PROMPTS, SAMPLING,
                        fresh_a=_fresh_a() if fresh == "startup" else None)


def test_the_weights_may_come_as_generators():
    """``checkpoint_tensors`` and ``fp4_stream`` yield: each list is read once (not emptied by a second pass)."""
    gen = lambda seed: checkpoint_tensors(tiny_model(seed=seed))  # noqa: E731
    assert refit_self_test(_make(), gen(1), gen(2), PROMPTS, SAMPLING)["refit/bit_exact"] == 1.0
    with pytest.raises(ValueError, match="two complete weight lists, got 0 and"):
        refit_self_test(_make(), [], gen(2), PROMPTS, SAMPLING)


def _trainer_logprobs(trainer: HFRolloutBackend):
    """The trainer's recompute of a rollout batch: one full forward with the same numerics."""

    def fn(batch):
        with trainer.forward_context() as model:
            logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long(), use_cache=True,
                           **trainer.cache_kwargs(trainer.new_cache())).logits.float()
        lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
        out = torch.zeros(batch.tokens.shape)
        out[:, 1:] = lp
        return torch.where(batch.response_mask, out, 0.0)

    return fn


def test_sentinel_after_sync_logs_and_fires_on_stale_weights(caplog):
    trainer = HFRolloutBackend(tiny_model(seed=1), mode="fp4", trace_config=CFG, dtype=torch.float32)
    rollout = HFRolloutBackend(tiny_model(seed=9), mode="fp4", trace_config=CFG, dtype=torch.float32)
    check = SentinelCheck(prompts=((5, 6, 7), (40, 41)), max_new_tokens=3, max_abs_diff=1e-3)
    with pytest.raises(SentinelError, match="after the sync to version 0"):  # never synced: stale
        check.run(rollout, _trainer_logprobs(trainer))
    sync_weights(rollout, checkpoint_tensors(trainer.model), fmt="fp4", quantizer=CFG.weight_quantizer(),
                 dtype=torch.float32, version=1)
    with caplog.at_level("INFO", logger="megatron_trace.monitor"):
        m = check.run(rollout, _trainer_logprobs(trainer))
    assert m["sentinel/logprob_abs_diff"] <= 1e-3 and m["sentinel/policy_version"] == 1.0
    assert "sentinel after sync to version 1" in caplog.text
    off = SentinelCheck(prompts=check.prompts, max_new_tokens=3)  # no threshold: log and return only
    stale = HFRolloutBackend(tiny_model(seed=9), mode="fp4", trace_config=CFG, dtype=torch.float32)
    assert off.run(stale, _trainer_logprobs(trainer))["sentinel/logprob_abs_diff"] > 1e-3


def test_batch_differences_see_amax_on_one_side_only_and_other_expert_ids():
    """A record with a global amax against one without differs, in either order (it was 'the same' one way round
    and a TypeError the other); so do records of other expert ids (they were not compared)."""
    batch = _fresh_a().generate(PROMPTS, SAMPLING)
    key = next(k for k, sg in batch.guidance.items() if sg.record.global_amax is not None)
    sg = batch.guidance[key]
    no_amax = dataclasses.replace(batch, guidance={**batch.guidance, key: dataclasses.replace(
        sg, record=dataclasses.replace(sg.record, global_amax=None))})
    assert batch_differences(batch, batch) == []
    assert batch_differences(batch, no_amax) == [f"guidance{key}"] == batch_differences(no_amax, batch)
    key = next(k for k, sg in batch.guidance.items() if sg.expert_ids is not None)
    sg = batch.guidance[key]
    ids = sg.expert_ids.clone()
    ids.view(-1)[0] += 1
    other = dataclasses.replace(batch, guidance={**batch.guidance, key: dataclasses.replace(sg, expert_ids=ids)})
    assert batch_differences(batch, other) == [f"guidance{key}"]


def test_batch_differences_name_each_field_that_differs_in_one_element():
    """One element changed in one field at a time is named, alone: the log-probs (a refit that moves them but not the
    sampled tokens), the tokens, one layer's routing, and a record's codes, block scales or valid rows."""
    batch = _fresh_a().generate(PROMPTS, SAMPLING)

    def one_off(t):
        t = t.clone()
        flat = t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.bool else t
        if t.dtype == torch.bool:
            flat.view(-1)[0] = ~flat.view(-1)[0]
        else:
            flat.view(-1)[0] += 1
        return t

    lp = batch.logprobs.clone()
    b, s = batch.response_mask.nonzero()[0].tolist()
    lp[b, s] -= 1e-3
    assert batch_differences(batch, dataclasses.replace(batch, logprobs=lp)) == ["logprobs"]
    assert batch_differences(batch, dataclasses.replace(batch, tokens=one_off(batch.tokens))) == ["tokens"]
    layer = next(iter(batch.routing))
    routing = {**batch.routing, layer: one_off(batch.routing[layer])}
    assert batch_differences(batch, dataclasses.replace(batch, routing=routing)) == [f"routing[{layer}]"]
    key, sg = next(iter(batch.guidance.items()))
    for field in ("codes", "block_scales"):
        rec = dataclasses.replace(sg.record, **{field: one_off(getattr(sg.record, field))})
        other = dataclasses.replace(batch, guidance={**batch.guidance, key: dataclasses.replace(sg, record=rec)})
        assert batch_differences(batch, other) == [f"guidance{key}"], field
    valid = dataclasses.replace(sg, valid=one_off(sg.valid))
    other = dataclasses.replace(batch, guidance={**batch.guidance, key: valid})
    assert batch_differences(batch, other) == [f"guidance{key}"]


def test_not_applied_sees_an_expert_whose_stored_amax_is_not_the_updates():
    """An update that differs from what the FP4 store holds only by a factor 2 (NVFP4: the same codes and block
    scales, another global amax) was not applied, and is named; the weights the store does hold are not."""
    be = _fresh_a()
    weights = _weights(1)
    assert not_applied(be, weights) == []
    p = "model.layers.1.mlp.experts.2."
    doubled = [(n, v * 2 if n.startswith(p) else v) for n, v in weights]
    q = be.weight_store.quantizer
    fc2 = dict(weights)[p + "down_proj.weight"]
    assert torch.equal(q.quantize(fc2 * 2).codes, q.quantize(fc2).codes)  # (only the amax tells them apart)
    assert sorted(not_applied(be, doubled)) == sorted(p + f"{w}_proj.weight" for w in ("gate", "up", "down"))


def test_a_nan_sentinel_fails_the_threshold():
    """A trainer recompute that returns NaN (a broken forward) must not pass the sentinel: NaN <= bound is false."""
    rollout = HFRolloutBackend(tiny_model(seed=9), mode="fp4", trace_config=CFG, dtype=torch.float32)
    check = SentinelCheck(prompts=((5, 6, 7),), max_new_tokens=2, max_abs_diff=1e-3)
    with pytest.raises(SentinelError, match="logprob_abs_diff=nan"):
        check.run(rollout, lambda batch: torch.full_like(batch.logprobs, float("nan")))


def test_not_applied_and_derived_state_see_each_part_of_a_stored_expert():
    """A stored expert whose block scales alone differ from the update is not applied; ``derived_state`` holds each
    stored matrix's codes, scales and amax (a stale amax is stale state); tensor dicts with other keys differ."""
    from megatron_trace.rollout.refit import _tensor_differences, derived_state

    be = _fresh_a()
    weights = _weights(1)
    key = (1, 2, "fc2")
    q = be.weight_store._w[key]
    scales = q.block_scales.view(torch.uint8).clone()
    scales.view(-1)[0] += 1
    be.weight_store._w[key] = dataclasses.replace(q, block_scales=scales.view(q.block_scales.dtype))
    assert not_applied(be, weights) == ["model.layers.1.mlp.experts.2.down_proj.weight"]
    gate = "model.layers.0.mlp.experts.1.gate_proj.weight"  # half an fc1 matrix: nothing to compare it with
    assert not_applied(be, [(gate, dict(weights)[gate] * 2)]) == []
    state = derived_state(be)
    assert len(state) == 3 * len(be.weight_store._w)
    assert torch.equal(state["weight_store.1.2.fc2.global_amax"], q.global_amax)
    t = torch.zeros(2)
    assert _tensor_differences({"a": t}, {"a": t, "b": t}, "x") == ["x: keys differ (['b'])"]
    assert _tensor_differences({"a": t, "b": t}, {"a": t}, "x") == ["x: keys differ (['b'])"]
    assert _tensor_differences({"a": t}, {"a": t + 1}, "x") == ["x a"]
