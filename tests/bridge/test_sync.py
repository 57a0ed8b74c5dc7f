import re

import pytest
import torch

from megatron_trace.bridge.sync import WeightBucket, bf16_stream, fp4_stream, sync_byte_counts, sync_weights
from megatron_trace.config import TraceConfig
from megatron_trace.formats import FP4Tensor
from megatron_trace.rollout import HFRolloutBackend, SamplingParams
from megatron_trace.rollout.hf_weights import checkpoint_tensors

from ..rollout._tiny import tiny_config, tiny_model

WQ = TraceConfig().weight_quantizer()
CFG = tiny_config()
E_NUMEL = CFG.num_hidden_layers * CFG.num_experts * 3 * CFG.moe_intermediate_size * CFG.hidden_size


def _trainer_weights():
    """What a bf16 trainer exports: HF checkpoint names, bf16 tensors (new policy)."""
    return list(checkpoint_tensors(tiny_model(seed=1, dtype=torch.bfloat16)))


def _rollout():
    return HFRolloutBackend(tiny_model(seed=0), mode="fp4", dtype=torch.bfloat16)


def test_fp4_sync_equals_bf16_sync_then_rollout_quantization():
    weights = _trainer_weights()
    via_bf16, via_fp4 = _rollout(), _rollout()
    s16 = sync_weights(via_bf16, weights, fmt="bf16", version=3)
    s4 = sync_weights(via_fp4, weights, fmt="fp4", quantizer=WQ, version=3)
    assert via_bf16.policy_version == via_fp4.policy_version == 3
    for layer in range(CFG.num_hidden_layers):
        for e in range(CFG.num_experts):
            for which in ("fc1", "fc2"):
                a, b = via_bf16.expert_weight_fp4(layer, e, which), via_fp4.expert_weight_fp4(layer, e, which)
                assert torch.equal(a.codes, b.codes) and torch.equal(a.global_amax, b.global_amax)
                assert torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))
    sa, sb = via_bf16.model.state_dict(), via_fp4.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    p = SamplingParams(max_new_tokens=6, seed=4)
    ra, rb = via_bf16.generate([[3, 4, 5], [9]], p), via_fp4.generate([[3, 4, 5], [9]], p)
    assert torch.equal(ra.tokens, rb.tokens) and torch.equal(ra.logprobs, rb.logprobs)
    # bytes moved: experts 16 bits vs 4 + 8/16 bits per element (+ one fp32 amax per shipped matrix)
    assert s16.bytes_experts == 2 * E_NUMEL
    n_mats = CFG.num_hidden_layers * CFG.num_experts * 3
    assert s4.bytes_experts == E_NUMEL // 2 + E_NUMEL // 16 + 4 * n_mats
    assert s4.bytes_other == s16.bytes_other and s4.tensors == s16.tensors
    assert 3.4 < s16.bytes_experts / s4.bytes_experts < 3.56


def test_byte_counts_without_syncing():
    counts = sync_byte_counts(_trainer_weights(), WQ)
    assert counts["bf16"].bytes_experts == 2 * E_NUMEL
    assert counts["fp4"].bytes_total < counts["bf16"].bytes_total
    d = counts["fp4"].as_dict()
    assert d["sync/fp4/bytes_total"] == counts["fp4"].bytes_total


def test_fp4_stream_quantizes_fc1_as_one_matrix():
    w = dict(_trainer_weights())
    out = dict(fp4_stream(w.items(), WQ))
    p = "model.layers.1.mlp.experts.2."
    gate, up = out[p + "gate_proj.weight"], out[p + "up_proj.weight"]
    assert isinstance(gate, FP4Tensor) and torch.equal(gate.global_amax, up.global_amax)
    whole = WQ.quantize(torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]))
    assert torch.equal(torch.cat([gate.codes, up.codes]), whole.codes)
    assert out["model.norm.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="partner"):
        list(fp4_stream([(p + "gate_proj.weight", w[p + "gate_proj.weight"])], WQ))
    with pytest.raises(ValueError, match="quantizer"):
        sync_weights(_rollout(), [], fmt="fp4")


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.1.mlp.experts.2.down_proj.weight",
                                  "model.layers.1.mlp.experts.2.up_proj.weight"])
def test_a_name_given_twice_is_refused_by_the_stream_and_by_the_sync(name):
    """A weight sent twice (the later copy used to win with no error): ``fp4_stream`` refuses it when it comes again,
    and a BF16 sync is refused by the rollout before anything is copied (its version unchanged)."""
    w = dict(_trainer_weights())
    twice = [*w.items(), (name, w[name])]
    with pytest.raises(ValueError, match=f"fp4_stream: {name!r} was given twice"):
        list(fp4_stream(twice, WQ))
    rollout = _rollout()
    with pytest.raises(ValueError, match="given more than once"):
        sync_weights(rollout, twice, fmt="bf16", version=3)
    assert rollout.policy_version == 0


def test_fp4_stream_of_fp32_weights_quantizes_what_a_bf16_trainer_does():
    """An fp32 stream (e.g. an fp32 HF directory): the experts are rounded to ``dtype`` before quantizing, so the
    codes equal the bf16 sync path's (the rollout quantizes the bf16 tensor) and a bf16 trainer's fake-quant."""
    w = dict(checkpoint_tensors(tiny_model(seed=1, dtype=torch.float32)))
    p = "model.layers.1.mlp.experts.2."
    fc1 = torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]])
    out = dict(fp4_stream(w.items(), WQ))
    got = torch.cat([out[p + "gate_proj.weight"].codes, out[p + "up_proj.weight"].codes])
    assert torch.equal(got, WQ.quantize(fc1.bfloat16()).codes)
    assert not torch.equal(got, WQ.quantize(fc1).codes)  # the fp32 values would give other codes here
    raw = dict(fp4_stream(w.items(), WQ, dtype=None))  # dtype=None: as given (an fp32 trainer)
    assert torch.equal(torch.cat([raw[p + "gate_proj.weight"].codes, raw[p + "up_proj.weight"].codes]),
                       WQ.quantize(fc1).codes)


def _per_expert(w: dict, quantizer) -> dict:
    """An independent computation: one ``Quantizer.quantize`` call per expert matrix (fc1 = [gate; up])."""
    out = {}
    for name, t in w.items():
        if name.endswith("down_proj.weight"):
            out[name] = quantizer.quantize(t)
        elif name.endswith("gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            whole = quantizer.quantize(torch.cat([t, w[up]]))
            n = t.shape[0]
            for half, rows in ((name, slice(0, n)), (up, slice(n, 2 * n))):
                out[half] = (whole.codes[rows], whole.block_scales[rows], whole.global_amax)
    return out


def _same(a, b) -> bool:
    codes, scales, amax = b if isinstance(b, tuple) else (b.codes, b.block_scales, b.global_amax)
    same_amax = (a.global_amax is None and amax is None) or torch.equal(a.global_amax, amax)
    return torch.equal(a.codes, codes) and torch.equal(a.block_scales.view(torch.uint8), scales.view(torch.uint8)) \
        and same_amax and (amax is None or a.global_amax.shape == amax.shape)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("batch_bytes", [1, 4096, 256 << 20])
def test_batched_expert_quantization_equals_one_call_per_expert(fmt, batch_bytes):
    quantizer = TraceConfig(format=fmt).weight_quantizer()
    w = dict(_trainer_weights())
    zero = "model.layers.0.mlp.experts.1.down_proj.weight"  # an all-zero expert: the per-expert fallback
    w[zero] = torch.zeros_like(w[zero])
    # interleave layers and put gate/up halves apart: grouping must not depend on the stream order
    names = sorted(w, key=lambda n: (n.endswith("up_proj.weight"), ".layers.1." not in n, n))
    out = dict(fp4_stream([(n, w[n]) for n in names], quantizer, batch_bytes=batch_bytes))
    want = _per_expert(w, quantizer)
    assert set(want) <= set(out) and len(out) == len(w)
    assert all(_same(out[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="batch_bytes=0"):
        list(fp4_stream(w.items(), quantizer, batch_bytes=0))


def test_batched_expert_quantization_reports_non_finite_weights():
    w = dict(_trainer_weights())
    bad = "model.layers.1.mlp.experts.0.down_proj.weight"
    w[bad] = w[bad].clone()
    w[bad][3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        list(fp4_stream(w.items(), WQ))


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_a_stale_version_is_refused_before_the_stream_is_read(fmt):
    """A sync at or below the rollout's version fails at once (no tensor staged or quantized) and changes nothing;
    strictly greater versions apply, and ``reset=True`` reloads an older version on purpose."""
    be = _rollout()
    sync_weights(be, _trainer_weights(), fmt=fmt, quantizer=WQ, version=2)
    state = {k: v.clone() for k, v in be.model.state_dict().items()}
    codes = be.expert_weight_fp4(1, 2, "fc1").codes.clone()
    read = []

    def stream(seed):
        for name, value in checkpoint_tensors(tiny_model(seed=seed, dtype=torch.bfloat16)):
            read.append(name)
            yield name, value

    for stale in (2, 1):
        with pytest.raises(ValueError, match=rf"version={stale} is not newer than the rollout's policy_version=2"):
            sync_weights(be, stream(3), fmt=fmt, quantizer=WQ, version=stale)
    assert read == [] and be.policy_version == 2
    after = be.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in state.items())
    assert torch.equal(be.expert_weight_fp4(1, 2, "fc1").codes, codes)
    sync_weights(be, stream(3), fmt=fmt, quantizer=WQ, version=3)
    assert be.policy_version == 3 and read and not torch.equal(be.expert_weight_fp4(1, 2, "fc1").codes, codes)
    sync_weights(be, _trainer_weights(), fmt=fmt, quantizer=WQ, version=2, reset=True)  # back to version 2's weights
    assert be.policy_version == 2 and torch.equal(be.expert_weight_fp4(1, 2, "fc1").codes, codes)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("batch_bytes", [1, 256 << 20], ids=["per-expert", "stacked"])
def test_non_finite_expert_weights_are_named_with_their_counts(fmt, batch_bytes):
    """Every non-finite weight of the failing quantize call is named (an fc1 matrix by the half that holds it), and
    the sync applies nothing."""
    from megatron_trace.bridge.sync import WeightSyncError
    from megatron_trace.formats import NonFiniteError

    w = dict(_trainer_weights())
    up, down = "model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.6.down_proj.weight"
    w[up], w[down] = w[up].clone(), w[down].clone()
    w[up][2, 2], w[down][0, 1], w[down][4, 4] = float("inf"), float("nan"), -float("inf")
    quantizer = TraceConfig(format=fmt).weight_quantizer()
    with pytest.raises(NonFiniteError, match=rf"{up} \(1\)" if batch_bytes == 1 else rf"2 .*{up} \(1\), {down} \(2\)"):
        list(fp4_stream(w.items(), quantizer, batch_bytes=batch_bytes))
    rollout = _rollout()
    with pytest.raises(WeightSyncError, match=rf"NonFiniteError: weight sync: .*{up} \(1\)"):
        sync_weights(rollout, list(w.items()), fmt="fp4", quantizer=quantizer, version=5)
    assert rollout.policy_version == 0


def test_a_bucket_gives_back_every_tensor_as_packed_whatever_its_size_and_dtype():
    """Tensors of odd byte sizes next to wider dtypes (an FP4 weight's odd count of fp8 scales, then its fp32 amax):
    each comes back from the bucket with its dtype, shape and bytes."""
    q = fp4_stream([("model.layers.0.mlp.experts.0.down_proj.weight", torch.randn(3, 16))], WQ)
    fp4 = dict(q)["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert fp4.block_scales.numel() % 4  # its fp32 amax follows an odd number of scale bytes
    items = [("a", torch.arange(3, dtype=torch.uint8)), ("b", torch.randn(5, dtype=torch.float32)),
             ("c", torch.randn(3, dtype=torch.bfloat16)), ("d", torch.arange(7, dtype=torch.int64)), ("e", fp4)]
    back = dict(WeightBucket.pack(items).values())
    for name, want in items[:4]:
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
    got = back["e"]
    assert torch.equal(got.codes, fp4.codes) and torch.equal(got.global_amax, fp4.global_amax)
    assert torch.equal(got.block_scales.view(torch.uint8), fp4.block_scales.view(torch.uint8))


def test_non_float_tensors_are_sent_as_they_are():
    """Only floating tensors are cast to the sync dtype (an integer buffer would lose its values in bf16)."""
    big = torch.tensor([257, 2**20 + 1])
    for stream in (bf16_stream([("model.buf", big)]), fp4_stream([("model.buf", big)], WQ)):
        (name, got), = list(stream)
        assert got.dtype == torch.int64 and torch.equal(got, big)


def test_bf16_layers_keep_the_experts_of_those_layers_only():
    """``bf16_layers`` names layers (not expert ids): every expert of layer 1 comes as the cast tensor, every expert
    of the other layers as FP4, through ``make_stream`` as ``sync_weights`` calls it."""
    from megatron_trace.bridge.sync import make_stream
    from megatron_trace.rollout.hf_weights import parse_expert_name

    w = _trainer_weights()
    out = dict(make_stream(w, "fp4", WQ, bf16_layers=(1,)))
    assert len(out) == len(w)
    for name, value in w:
        parsed = parse_expert_name(name)
        if parsed is not None and parsed[0] != 1:
            assert isinstance(out[name], FP4Tensor), name
        else:
            assert isinstance(out[name], torch.Tensor) and torch.equal(out[name], value), name


def test_byte_counts_of_an_fp32_sync():
    """``sync_byte_counts(..., dtype)`` counts the tensors as sent in ``dtype``: fp32 is 4 bytes an element."""
    w = list(checkpoint_tensors(tiny_model(seed=1, dtype=torch.float32)))
    c32, c16 = sync_byte_counts(w, WQ, torch.float32), sync_byte_counts(w, WQ)
    assert c32["bf16"].bytes_experts == 4 * E_NUMEL == 2 * c16["bf16"].bytes_experts
    assert c32["bf16"].bytes_other == c32["fp4"].bytes_other == 2 * c16["fp4"].bytes_other
    assert c32["fp4"].bytes_experts == c16["fp4"].bytes_experts


@pytest.mark.parametrize("trainer_rule, sent_rule", [("floor", "ceil"), ("ceil", "floor")])
def test_fp4_codes_of_another_scale_rule_than_the_trainer_recipes_are_refused(trainer_rule, sent_rule):
    """The rollout takes FP4 codes as they come (an MXFP4 payload does not say its scale rule), so codes quantized
    with another rule than the trainer's were applied although the recipe was checked (2316 of 16384 down_proj
    elements differed from the trainer's fake-quant in a probe). With the recipe, ``sync_weights`` refuses them
    before the stream is read; the recipe's own quantizer gives the trainer's weights."""
    cfg = TraceConfig(format="mxfp4", mxfp4_scale_rule=trainer_rule)
    rollout = HFRolloutBackend(tiny_model(seed=0), mode="fp4", trace_config=cfg, dtype=torch.bfloat16)
    recipe = rollout.recipe().with_weight_version(1)  # what a trainer of this config sends (its check passes)
    rollout.check_recipe(recipe, weight_version=1)
    weights = _trainer_weights()
    sent = TraceConfig(format="mxfp4", mxfp4_scale_rule=sent_rule).weight_quantizer()
    with pytest.raises(ValueError, match=f"scale_rule='{sent_rule}'.* is not the trainer recipe's weight quantizer "
                                         f"\\(format='mxfp4', scale_rule='e8m0_{trainer_rule}'"):
        sync_weights(rollout, weights, fmt="fp4", quantizer=sent, version=1, recipe=recipe)
    assert rollout.policy_version == 0
    sync_weights(rollout, weights, fmt="fp4", quantizer=cfg.weight_quantizer(), version=1, recipe=recipe)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    want = cfg.weight_quantizer().fake_quantize(dict(weights)[name])
    assert torch.equal(rollout.model.model.layers[1].mlp.experts.down_proj[2], want)


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.float64, torch.float8_e4m3fn, "bfloat16"])
def test_a_sync_dtype_the_quantizer_does_not_take_is_refused_before_the_stream_is_read(fmt, dtype):
    """``dtype=torch.int8`` (or bool) truncated every weight on a BF16 sync and the rollout copied the integers in (85
    of 85 tensors changed, with no error); on an FP4 sync the quantizer failed after part of the stream was read.
    Refused by name before any tensor is read, nothing changed; the streams themselves refuse it too."""
    rollout, read = _rollout(), []

    def stream():
        for item in _trainer_weights():
            read.append(item[0])
            yield item

    with pytest.raises(ValueError, match=rf"dtype={dtype!r} is not one of \(torch.float32, torch.bfloat16, "
                                         r"torch.float16\) or None"):
        sync_weights(rollout, stream(), fmt=fmt, quantizer=WQ, dtype=dtype, version=1)
    assert read == [] and rollout.policy_version == 0
    with pytest.raises(ValueError, match=rf"dtype={dtype!r} is not one of"):
        list(bf16_stream(_trainer_weights(), dtype) if fmt == "bf16" else fp4_stream(_trainer_weights(), WQ, dtype))


@pytest.mark.parametrize("layers", ["1", 1, (1.5,), (-1,), (None,)])
def test_bf16_layers_that_are_not_layer_numbers_are_refused_by_name(layers):
    """``bf16_layers="1"`` matched no layer (its characters are not layer numbers): every expert went as FP4 with no
    error; a bare int failed as "'int' object is not iterable" after the sync had started. Refused by name, before the
    stream is read, by the sync and by ``fp4_stream``."""
    rollout, read = _rollout(), []

    def stream():
        for item in _trainer_weights():
            read.append(item[0])
            yield item

    with pytest.raises(ValueError, match=rf"bf16_layers={re.escape(repr(layers))} must be a collection of layer "
                                         r"numbers \(ints >= 0\)"):
        sync_weights(rollout, stream(), fmt="fp4", quantizer=WQ, bf16_layers=layers, version=1)
    assert read == [] and rollout.policy_version == 0
    with pytest.raises(ValueError, match="must be a collection of layer numbers"):
        list(fp4_stream(_trainer_weights(), WQ, bf16_layers=layers))
