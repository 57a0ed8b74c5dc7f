import dataclasses

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.rollout import HFRolloutBackend
from megatron_trace.rollout.hf_weights import checkpoint_tensors, join_fc1, split_fc1

from ._tiny import tiny_model


def _backend(mode="fp4", seed=0):
    return HFRolloutBackend(tiny_model(seed=seed), mode=mode, dtype=torch.float32)


def test_bf16_update_copies_in_place_and_bumps_version():
    be = _backend(mode="bf16")
    new = dict(checkpoint_tensors(tiny_model(seed=1)))
    ptrs = {n: p.data_ptr() for n, p in be.model.named_parameters()}
    be.update_weights(new.items())
    assert be.policy_version == 1
    assert {n: p.data_ptr() for n, p in be.model.named_parameters()} == ptrs
    got = dict(checkpoint_tensors(be.model))
    assert got.keys() == new.keys() and all(torch.equal(got[k], new[k]) for k in new)
    be.update_weights([], version=7)
    assert be.policy_version == 7


def test_fp4_bf16_update_requantizes_touched_experts():
    be = _backend()
    new = dict(checkpoint_tensors(tiny_model(seed=1)))
    p = "model.layers.2.mlp.experts.3."
    be.update_weights([(p + "gate_proj.weight", new[p + "gate_proj.weight"]),
                       (p + "up_proj.weight", new[p + "up_proj.weight"])])
    fc1 = torch.cat([new[p + "gate_proj.weight"], new[p + "up_proj.weight"]])
    want = TraceConfig().weight_quantizer().quantize(fc1)
    assert torch.equal(be.expert_weight_fp4(2, 3, "fc1").codes, want.codes)
    assert torch.equal(be.model.model.layers[2].mlp.experts.gate_up_proj[3], want.dequantize())


def test_fc1_split_join_round_trip():
    q = TraceConfig().weight_quantizer().quantize(torch.randn(64, 48))
    gate, up = split_fc1(q)
    assert gate.shape == (32, 48) and torch.equal(join_fc1(gate, up).codes, q.codes)
    assert torch.equal(join_fc1(gate, up).dequantize(), q.dequantize())


def test_split_join_refuse_what_is_not_one_fc1_matrix():
    """``join_fc1`` refuses halves of another K, format or global amax (one fc1 matrix has one), ``split_fc1`` a
    per-row amax or an odd row count, each by name (not a shape error of a later cat, nor a silent mix)."""
    wq = TraceConfig().weight_quantizer()
    q = wq.quantize(torch.randn(64, 48))
    gate, up = split_fc1(q)
    for other in (split_fc1(wq.quantize(torch.randn(64, 32)))[1],
                  split_fc1(TraceConfig(format="mxfp4").weight_quantizer().quantize(torch.randn(64, 48)))[1]):
        with pytest.raises(ValueError, match="do not form one fc1 matrix"):
            join_fc1(gate, other)
    for amax in (up.global_amax * 2, None):
        with pytest.raises(ValueError, match="share one global amax"):
            join_fc1(gate, dataclasses.replace(up, global_amax=amax))
    with pytest.raises(ValueError, match="per-row global_amax"):
        split_fc1(dataclasses.replace(q, global_amax=torch.ones(64, 1)))
    with pytest.raises(ValueError, match="even number of rows"):
        split_fc1(wq.quantize(torch.randn(3, 48)))


@pytest.mark.parametrize("case, err, match", [
    ("unknown", KeyError, "not a weight"),
    ("shape", ValueError, "shape"),
    ("shape_same_numel", ValueError, r"q_proj.weight': shape \(32, 128\) != the model's \(64, 64\)"),
    ("fp4_dense", ValueError, "routed experts only"),
    ("half_fc1", ValueError, "gate_proj and up_proj together"),
    ("bad_expert", KeyError, "no routed expert 8"),
    ("fp4_in_bf16_mode", ValueError, "mode='fp4'"),
    ("fp4_shape", ValueError, r"expert 1 fc2 has shape \(64, 40\), the model expects \(64, 32\)"),
    ("fc1_amax", ValueError, "share one global amax"),
    ("fp4_half_fc1", ValueError, "layer 0 expert 1: FP4 fc1 needs gate_proj and up_proj together"),
    ("fp4_nan_scale", ValueError, "expert 1 fc2: its block scales hold NaN/Inf"),
    # were accepted: a negative E4M3 scale flipped the block's signs, an amax of 0 (S_enc = 1) beside nonzero scales
    # decoded the weight 2688 / amax times too large
    ("fp4_negative_scale", ValueError, r"expert 1 fc2: rows \[0, 1, 2, 3\] have a negative block scale or amax"),
    ("fp4_zero_amax", ValueError, r"expert 1 fc2: rows \[0, 1, 2, 3\] have .*an amax of 0 beside a nonzero"),
    ("nan_expert", ValueError, r"hold NaN/Inf, e.g. \['model.layers.0.mlp.experts.1.gate_proj.weight'\]"),
    ("nan_dense", ValueError, r"\['model.layers.1.self_attn.q_proj.weight'\]; nothing was updated"),
    # were: int values cast into the float weight (FP4 codes sent as a dense tensor loaded as integers), a meta
    # tensor a bare "Cannot copy out of meta tensor"
    ("int_dense", TypeError, r"q_proj.weight': torch.uint8 values for the model's torch.float32 weight: give float"),
    ("bool_dense", TypeError, r"input_layernorm.weight': torch.bool values for the model's torch.float32 weight"),
    ("meta_dense", ValueError, r"q_proj.weight': a meta tensor holds no values"),
])
def test_update_weights_rejects_bad_input_before_copying(case, err, match):
    be = _backend(mode="bf16" if case == "fp4_in_bf16_mode" else "fp4")
    before = {k: v.clone() for k, v in be.model.state_dict().items()}
    q = TraceConfig().weight_quantizer().quantize(torch.randn(32, 64))
    good = ("model.norm.weight", torch.zeros(64))
    stored = be.expert_weight_fp4(0, 1, "fc2") if be.mode == "fp4" else None
    wq = TraceConfig().weight_quantizer()
    gate, up = wq.quantize(torch.randn(32, 64)), wq.quantize(torch.randn(32, 64))
    fc2 = wq.quantize(torch.randn(64, 32))
    first_scales = lambda byte: dataclasses.replace(fc2, block_scales=fc2.block_scales.view(  # noqa: E731
        torch.uint8).index_fill(1, torch.tensor([0]), byte).view(fc2.block_scales.dtype))  # every row's first block
    nan_scale, neg_scale = first_scales(0x7F), first_scales(0xB8)  # E4M3 NaN, -1.0
    zero_amax = dataclasses.replace(fc2, global_amax=torch.zeros_like(fc2.global_amax))
    nan_w = torch.zeros(32, 64)
    nan_w[3, 5] = float("nan")
    e1 = "model.layers.0.mlp.experts.1."
    pairs = {
        "fc1_amax": [(e1 + "gate_proj.weight", gate), (e1 + "up_proj.weight", up)],
        "fp4_half_fc1": [(e1 + "gate_proj.weight", gate)],
        "nan_expert": [(e1 + "gate_proj.weight", nan_w), (e1 + "up_proj.weight", torch.zeros(32, 64))],
    }
    bad = {
        "unknown": ("model.layers.0.mlp.shared_expert.weight", torch.zeros(1)),
        "shape": ("model.layers.0.input_layernorm.weight", torch.zeros(63)),
        "shape_same_numel": ("model.layers.1.self_attn.q_proj.weight", torch.zeros(32, 128)),
        "fp4_dense": ("model.layers.0.input_layernorm.weight", q),
        "half_fc1": ("model.layers.0.mlp.experts.1.up_proj.weight", torch.zeros(32, 64)),
        "bad_expert": ("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(32, 64)),
        "fp4_in_bf16_mode": ("model.layers.0.mlp.experts.1.down_proj.weight", q),
        "fp4_shape": (e1 + "down_proj.weight", wq.quantize(torch.randn(64, 40))),
        "fp4_nan_scale": (e1 + "down_proj.weight", nan_scale),
        "fp4_negative_scale": (e1 + "down_proj.weight", neg_scale),
        "fp4_zero_amax": (e1 + "down_proj.weight", zero_amax),
        "nan_dense": ("model.layers.1.self_attn.q_proj.weight", torch.full((64, 64), float("inf"))),
        "int_dense": ("model.layers.1.self_attn.q_proj.weight", torch.ones(64, 64, dtype=torch.uint8)),
        "bool_dense": ("model.layers.0.input_layernorm.weight", torch.ones(64, dtype=torch.bool)),
        "meta_dense": ("model.layers.1.self_attn.q_proj.weight", torch.empty(64, 64, device="meta")),
    }.get(case)
    with pytest.raises(err, match=match):
        be.update_weights([good, *pairs.get(case, [bad])])  # everything is checked before anything is copied
    after = be.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and be.policy_version == 0
    if stored is not None:
        assert torch.equal(be.expert_weight_fp4(0, 1, "fc2").codes, stored.codes)


def test_fused_expert_names_are_refused_in_fp4_mode():
    """transformers' fused ``experts.gate_up_proj`` would be copied unquantized past the FP4 store."""
    new = dict(tiny_model(seed=1).named_parameters())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    be = _backend()
    with pytest.raises(ValueError, match="FP4 experts are updated per expert"):
        be.update_weights([(name, new[name].detach())])
    assert be.policy_version == 0
    bf16 = _backend(mode="bf16")  # nothing quantized: the fused tensor is the weight
    bf16.update_weights([(name, new[name].detach())])
    assert torch.equal(bf16.model.model.layers[0].mlp.experts.gate_up_proj, new[name])


def test_fp4_updates_are_copied_not_kept_as_views():
    """A receive buffer reused for the next bucket must not change the store (what the CUDA decode reads)."""
    be = _backend()
    q = TraceConfig().weight_quantizer().quantize(torch.randn(64, 32))
    be.update_weights([("model.layers.1.mlp.experts.2.down_proj.weight", q)])
    want = q.codes.clone()
    q.codes.zero_()  # the caller's buffer is reused
    got = be.expert_weight_fp4(1, 2, "fc2")
    assert torch.equal(got.codes, want) and got.codes.data_ptr() != q.codes.data_ptr()
    assert torch.equal(be.model.model.layers[1].mlp.experts.down_proj[2], got.dequantize())


def _snapshot(be):
    """The backend's dense weights and (FP4 mode) every stored expert code, cloned."""
    state = {k: v.clone() for k, v in be.model.state_dict().items()}
    codes = {} if be.weight_store is None else {
        (layer, e, w): be.expert_weight_fp4(layer, e, w).codes.clone()
        for layer in range(3) for e in range(8) for w in ("fc1", "fc2")}
    return state, codes


def _same(a, b) -> bool:
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) \
        and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("mode", ["fp4", "bf16"])
@pytest.mark.parametrize("stale", [3, 2, 0])
def test_an_update_at_or_below_the_current_version_is_refused_before_anything_changes(mode, stale):
    """A version names one set of weights: a second update under version 3 (or an older one) would let guidance and
    samples recorded under that version pass the trainer's version check against other weights."""
    be = _backend(mode=mode)
    be.update_weights(checkpoint_tensors(tiny_model(seed=1)), version=3)
    before = _snapshot(be)
    new = list(checkpoint_tensors(tiny_model(seed=2)))
    with pytest.raises(ValueError, match=rf"version={stale} is not newer than the rollout's policy_version=3: a weight "
                                         r"update's version must be strictly greater \(> 3; version=None sets 4\)"):
        be.update_weights(new, version=stale)
    assert be.policy_version == 3 and _same(_snapshot(be), before)
    be.update_weights(new, version=4)  # strictly increasing versions apply
    assert be.policy_version == 4 and not _same(_snapshot(be), before)
    got = dict(checkpoint_tensors(be.model))
    if mode == "bf16":
        assert all(torch.equal(got[k], v) for k, v in new)
    be.update_weights([], version=None)  # None: the next version
    assert be.policy_version == 5


@pytest.mark.parametrize("version, match", [(True, "version=True"), (2.0, "version=2.0"), (-1, "version=-1"),
                                            ("3", "version='3'")])
def test_a_version_that_is_not_an_int_at_least_0_is_refused(version, match):
    be = _backend(mode="bf16")
    with pytest.raises(ValueError, match=match + r" must be None or an int >= 0"):
        be.update_weights([("model.norm.weight", torch.zeros(64))], version=version)
    assert be.policy_version == 0
    assert torch.equal(be.model.model.norm.weight, tiny_model().model.norm.weight)


def test_reset_sets_any_version_on_purpose():
    """Reloading a checkpoint / rolling back: ``reset=True`` with the checkpoint's version (lower or equal)."""
    be = _backend(mode="fp4")
    be.update_weights(checkpoint_tensors(tiny_model(seed=1)), version=5)
    old = list(checkpoint_tensors(tiny_model(seed=0)))
    with pytest.raises(ValueError, match="reset=True needs the version of the weights it loads"):
        be.update_weights(old, reset=True)
    assert be.policy_version == 5
    be.update_weights(old, version=2, reset=True)
    fresh = _backend(mode="fp4")
    assert be.policy_version == 2 and _same(_snapshot(be), _snapshot(fresh))
    be.update_weights(old, version=2, reset=True)  # the same version again, on purpose
    assert be.policy_version == 2
    with pytest.raises(ValueError, match="version=2 is not newer"):
        be.update_weights(old, version=2)  # without reset, the rule applies again


def test_a_value_beyond_the_model_dtypes_range_is_refused_before_anything_changes():
    """A float32 value beyond float16's range copies into a float16 model as Inf: checked in fp32 it passed, the
    update failed mid-copy at the expert's FP4 re-quantize, and the model kept part of the new weights (the embeddings,
    the experts re-quantized before it) under the old policy_version, generating from them."""
    be = HFRolloutBackend(tiny_model(), mode="fp4", dtype=torch.float16)
    before = {k: v.clone() for k, v in be.model.state_dict().items()}
    new = [(n, t.float().clone()) for n, t in checkpoint_tensors(tiny_model(seed=1))]
    bad = "model.layers.2.mlp.experts.3.down_proj.weight"
    dict(new)[bad][0, 0] = 1e6
    with pytest.raises(ValueError, match=rf"hold NaN/Inf, e.g. \['{bad}'\]; nothing was updated \(checked as the "
                                         r"model's torch.float16"):
        be.update_weights(new)
    after = be.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and be.policy_version == 0
    dict(new)[bad][0, 0] = 1.0
    be.update_weights(new)
    assert be.policy_version == 1


@pytest.mark.parametrize(("weights", "match"), [
    ({"model.norm.weight": torch.ones(64)}, r"got a dict: pass weights.items\(\)"),
    ([("model.norm.weight", torch.ones(64)), ("model.norm.weight",)], r"weights\[1\] must be a \(name, tensor\) pair"),
    ([torch.ones(64)], r"weights\[0\] must be a \(name, tensor\) pair .*got Tensor"),
])
def test_weights_that_are_not_name_value_pairs_are_named(weights, match):
    """A state dict passed itself (not its .items()) iterated over its names: 'too many values to unpack'."""
    from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend

    from ..sglang.test_backend_contract import CFG, HF, _Engine

    for be in (_backend(), SGLangRolloutBackend(_Engine(), CFG.replace(kv_format="sglang_kvfp4"), HF, native=False)):
        with pytest.raises(TypeError, match=match):
            be.update_weights(weights)
        assert be.policy_version == 0


def test_a_weight_name_given_twice_is_refused_before_anything_is_copied():
    """Which of two copies of one name is meant is unknown: both backends refuse the update by name (the later copy
    used to win silently), leaving the version and the weights as they were."""
    from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend

    from ..sglang.test_backend_contract import CFG, HF, _Engine

    new = dict(checkpoint_tensors(tiny_model(seed=1)))
    p = "model.layers.1.mlp.experts.0."
    twice = [*new.items(), ("model.norm.weight", new["model.norm.weight"] + 1),
             (p + "down_proj.weight", new[p + "down_proj.weight"])]
    be = _backend()
    before = {k: v.clone() for k, v in checkpoint_tensors(be.model)}
    with pytest.raises(ValueError, match=r"2 weight name\(s\) given more than once.*"
                                         r"'model.layers.1.mlp.experts.0.down_proj.weight', 'model.norm.weight'"):
        be.update_weights(twice)
    assert be.policy_version == 0
    assert all(torch.equal(v, before[k]) for k, v in checkpoint_tensors(be.model))
    eng = _Engine()
    sg = SGLangRolloutBackend(eng, CFG.replace(kv_format="sglang_kvfp4"), HF, native=False)
    with pytest.raises(ValueError, match="given more than once"):
        sg.update_weights([("model.norm.weight", torch.ones(64)), ("model.norm.weight", torch.zeros(64))])
    assert sg.policy_version == 0 and eng.updates == []



def test_bf16_updates_of_excluded_experts_are_used_as_they_come():
    """``exclude_modules`` keeps layer 0's experts in the model dtype: their BF16 update is copied as it is (not
    re-quantized to FP4 values) and the FP4 store gets none of them; layer 2's update is re-quantized."""
    cfg = TraceConfig(exclude_modules=("model.layers.0.mlp.experts",))
    be = HFRolloutBackend(tiny_model(seed=0), mode="fp4", trace_config=cfg, dtype=torch.float32)
    new = dict(checkpoint_tensors(tiny_model(seed=1)))
    names = [f"model.layers.{layer}.mlp.experts.1.{p}_proj.weight" for layer in (0, 2) for p in ("gate", "up", "down")]
    be.update_weights([(n, new[n]) for n in names])
    experts = be.model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[1], torch.cat([new[names[0]], new[names[1]]]))
    assert torch.equal(experts.down_proj[1], new[names[2]])
    for which in ("fc1", "fc2"):
        with pytest.raises(KeyError, match="no FP4 weight for layer=0 expert=1"):
            be.expert_weight_fp4(0, 1, which)
    want = TraceConfig().weight_quantizer().quantize(new[names[5]])
    assert torch.equal(be.model.model.layers[2].mlp.experts.down_proj[1], want.dequantize())


def test_excluded_experts_take_fused_bf16_names_and_refuse_fp4_values():
    """Layer 0's experts kept in BF16 (``exclude_modules``) are updated as they come: transformers' fused
    ``gate_up_proj`` name is copied as it is there (refused only where experts are FP4: layer 2), and an FP4 value for
    them is refused by name (it would be stored as FP4 weights of experts the model runs in BF16)."""
    cfg = TraceConfig(exclude_modules=("model.layers.0.mlp.experts",))
    be = HFRolloutBackend(tiny_model(seed=0), mode="fp4", trace_config=cfg, dtype=torch.float32)
    new = dict(tiny_model(seed=1).named_parameters())
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    be.update_weights([(fused, new[fused].detach())])
    assert torch.equal(be.model.model.layers[0].mlp.experts.gate_up_proj, new[fused]) and be.policy_version == 1
    with pytest.raises(ValueError, match="FP4 experts are updated per expert"):
        be.update_weights([("model.layers.2.mlp.experts.gate_up_proj",
                            new["model.layers.2.mlp.experts.gate_up_proj"].detach())])
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    q = TraceConfig().weight_quantizer().quantize(dict(checkpoint_tensors(tiny_model(seed=1)))[name])
    before = be.model.model.layers[0].mlp.experts.down_proj[1].clone()
    with pytest.raises(ValueError, match=r"exclude_modules keeps 'model\.layers\.0\.mlp\.experts' in BF16"):
        be.update_weights([(name, q)])
    assert be.policy_version == 1 and torch.equal(be.model.model.layers[0].mlp.experts.down_proj[1], before)


class _CopyFails(torch.Tensor):
    """A weight whose copy to the model's device fails (as an out-of-memory copy to a GPU would), after the update's
    checks: a stand-in for the transport, not for the backend."""

    def to(self, *args, **kwargs):
        raise RuntimeError("out of memory copying to the device")


def test_an_update_that_fails_while_copying_is_not_served_until_its_tensors_are_sent_again():
    """Everything is checked before the copies, but a copy itself can fail (a device out of memory, an interrupt):
    the tensors before it were new, the version the old one, and generate served the mix as that version."""
    from megatron_trace.rollout import SamplingParams

    be, fresh = _backend(mode="bf16"), _backend(mode="bf16")
    new = list(checkpoint_tensors(tiny_model(seed=1)))
    broken = [(n, torch.Tensor._make_subclass(_CopyFails, v) if i == len(new) // 2 else v)
              for i, (n, v) in enumerate(new)]
    with pytest.raises(RuntimeError, match="out of memory copying"):
        be.update_weights(broken)
    assert be.policy_version == 0
    prompts, sampling = [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=2)
    with pytest.raises(RuntimeError, match=rf"failed while copying into the model .*policy_version=0.*{len(new)} "
                                           r"tensor\(s\) of the failed update not sent since"):
        be.generate(prompts, sampling)
    be.update_weights(new[:1])  # part of them again: still refused
    with pytest.raises(RuntimeError, match=rf"{len(new) - 1} tensor\(s\)"):
        be.generate(prompts, sampling)
    be.update_weights(new)
    fresh.update_weights(new)
    assert be.failed_update is None and be.policy_version == 2
    got, want = be.generate(prompts, sampling), fresh.generate(prompts, sampling)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
