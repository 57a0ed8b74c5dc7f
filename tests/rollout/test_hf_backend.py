import pytest
import torch

from megatron_trace.config import ACTIVATION_SITES, TraceConfig
from megatron_trace.formats import CompactGuidance, FullGuidance
from megatron_trace.metrics import quant_counts
from megatron_trace.rollout import HFRolloutBackend, RolloutBackend, SamplingParams
from megatron_trace.rollout.hf_weights import checkpoint_tensors
from megatron_trace.rollout.recorder import GuidanceRecorder

from ._tiny import tiny_config, tiny_model

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [40]]
FULL_ALL = TraceConfig(guided_layers="all", cache_mode="full")


def backend(mode="fp4", config=FULL_ALL, dtype=torch.float32, seed=0, **kw):
    return HFRolloutBackend(tiny_model(seed=seed), mode=mode, trace_config=config, dtype=dtype, **kw)


@pytest.fixture(scope="module")
def fp4():
    return backend()


def full_forward(be, batch, temperature=1.0, recorder=None):
    """Re-forward the rollout's tokens with the rollout numerics (FP4 KV included) -> logprobs [B, S]."""
    with be.forward_context(recorder) as model:
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long(), use_cache=True,
                       **be.cache_kwargs(be.new_cache(recorder))).logits.float()
    if recorder is not None:
        recorder.end_step(batch.attention_mask)
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)[:, :-1]
    out = torch.zeros(batch.tokens.shape, device=batch.tokens.device)
    out[:, 1:] = logp.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    return torch.where(batch.response_mask, out, 0.0)


def test_is_a_rollout_backend(fp4):
    assert isinstance(fp4, RolloutBackend)


def test_batch_layout(fp4):
    out = fp4.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=3))
    b, s = out.tokens.shape
    assert out.response_lens.tolist() == [5, 5, 5] and out.finish_reasons == ("length",) * 3
    assert s == max(len(p) for p in PROMPTS) + 5
    for i, p in enumerate(PROMPTS):
        assert out.tokens[i, : len(p)].tolist() == p
        assert out.tokens[i, len(p) + 5:].eq(fp4.pad_token_id).all()
        assert out.response_mask[i].nonzero().squeeze(1).tolist() == list(range(len(p), len(p) + 5))
    assert (out.logprobs[out.response_mask] < 0).all() and (out.logprobs[~out.response_mask] == 0).all()
    assert set(out.routing) == {0, 1, 2}
    assert set(out.guidance) == {(layer, s) for layer in range(3) for s in ACTIVATION_SITES}
    attn = out.attention_mask
    fc1, fc2, kv = out.guidance[(1, "expert_fc1_in")], out.guidance[(1, "expert_fc2_in")], out.guidance[(1, "kv_k")]
    assert isinstance(fc1.record, FullGuidance)
    assert fc1.record.shape == (b, s, 64) and fc2.record.shape == (b, s, 2, 32) and kv.record.shape == (b, s, 2, 16)
    assert torch.equal(fc1.valid, attn) and torch.equal(kv.valid, attn)
    assert torch.equal(fc2.valid, attn[..., None].expand(-1, -1, 2))
    assert torch.equal(fc2.expert_ids, out.routing[1])
    assert (fc1.record.codes[~attn] == 0).all() and (fc1.record.global_amax[~attn] == 0).all()


def test_seed_makes_sampling_reproducible(fp4):
    p = SamplingParams(max_new_tokens=6, seed=11)
    a, b = fp4.generate(PROMPTS, p), fp4.generate(PROMPTS, p)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert all(torch.equal(a.routing[k], b.routing[k]) for k in a.routing)
    key = (2, "expert_fc2_in")
    assert torch.equal(a.guidance[key].record.codes, b.guidance[key].record.codes)
    c = fp4.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=12))
    assert not torch.equal(a.tokens, c.tokens)


def test_stop_tokens_and_max_tokens(fp4):
    stop = tuple(range(0, 128, 4))  # a quarter of the vocabulary: most sequences stop early
    out = fp4.generate(PROMPTS * 4, SamplingParams(max_new_tokens=12, stop_token_ids=stop, seed=0))
    assert "stop" in out.finish_reasons
    for resp, reason in zip(out.responses(), out.finish_reasons):
        assert 1 <= len(resp) <= 12
        assert all(t not in stop for t in resp[:-1])
        assert (resp[-1] in stop) == (reason == "stop")
        assert reason == "stop" or len(resp) == 12


@pytest.mark.parametrize("prompts, sampling, err", [
    ([[1, 2]], SamplingParams(stop_token_ids=(500,)), ValueError),
    ([], SamplingParams(), ValueError),
    ([[1], []], SamplingParams(), ValueError),
    ([[1, 999]], SamplingParams(), ValueError),
    ([[1, 2]], {"temperature": 1.0}, TypeError),
])
def test_generate_rejects_bad_input(fp4, prompts, sampling, err):
    with pytest.raises(err):
        fp4.generate(prompts, sampling)


def test_positions_beyond_the_model_and_non_int_layer_ids_are_refused(fp4):
    import numpy as np

    limit = fp4.hf_config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompts\[0\] has {limit - 2} tokens: with max_new_tokens=3 that is "
                                         rf"{limit + 1} positions, beyond max_position_embeddings={limit}"):
        fp4.generate([[1] * (limit - 2)], SamplingParams(max_new_tokens=3))
    with pytest.raises(TypeError, match=r"guided layer id 1\.5 \(float\) must be an int"):
        fp4.set_guided_layers([1.5])
    before = set(fp4.guided_sites)
    try:
        fp4.set_guided_layers([np.int64(1)])
        assert fp4.guided_sites and all(type(layer) is int and layer == 1 for layer, _ in fp4.guided_sites)
    finally:
        fp4.set_guided_layers()
    assert fp4.guided_sites == before


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_are_those_of_the_sampling_forward(fp4, temperature):
    out = fp4.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=temperature, seed=5))
    recorder = GuidanceRecorder(out.batch_size, fp4.guided_sites, compact=False)
    ref = full_forward(fp4, out, temperature, recorder)
    m = out.response_mask
    assert torch.allclose(out.logprobs[m], ref[m], atol=1e-4)
    # what the rollout recorded position by position == what a full forward over its tokens records
    pos = torch.arange(out.tokens.shape[1]).expand_as(out.tokens)
    routing, guidance = recorder.finish(pos, out.attention_mask)
    for key, site in out.guidance.items():
        c = quant_counts(guidance[key].record, site.record, rows=site.valid)
        assert c.mismatched <= 0.01 * c.elements, key
    for layer, r in out.routing.items():
        assert (routing[layer] == r)[out.attention_mask].float().mean() > 0.99


def test_left_padding_does_not_change_results():
    be = backend(mode="fp4")
    p = SamplingParams(max_new_tokens=6, temperature=0)
    batch = be.generate(PROMPTS, p)
    for i, prompt in enumerate(PROMPTS):
        alone = be.generate([prompt], p)
        assert alone.responses()[0] == batch.responses()[i]
        m = alone.response_mask[0]
        assert torch.allclose(alone.logprobs[0][m], batch.logprobs[i][batch.response_mask[i]], atol=1e-4)


def test_guided_layer_and_site_selection():
    cfg = TraceConfig(guided_layers="last_k", guided_last_k=1, guided_sites=("expert_fc2_in",), cache_mode="compact")
    be = backend(config=cfg)
    out = be.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))
    assert set(out.guidance) == {(2, "expert_fc2_in")}
    assert isinstance(out.guidance[(2, "expert_fc2_in")].record, CompactGuidance)
    be.set_guided_layers([0, 1])
    assert be.guided_sites == {(0, "expert_fc2_in"), (1, "expert_fc2_in")}
    with pytest.raises(ValueError, match="outside"):
        be.set_guided_layers([3])
    bf16 = backend(mode="bf16")
    out = bf16.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))
    assert out.guidance == {} and set(out.routing) == {0, 1, 2}
    with pytest.raises(ValueError, match="mode"):
        HFRolloutBackend(tiny_config(), mode="int8")


def test_explicit_guided_layers_without_a_guided_module_are_refused():
    """``set_guided_layers(ids)`` dropped the layers whose experts ``exclude_modules`` keeps in BF16: layer 1 was in
    the recipe's guided layers while nothing recorded there (the policy's layers were checked, explicit ids not)."""
    cfg = TraceConfig(guided_sites=("expert_fc2_in",), exclude_modules=("model.layers.1.mlp.experts",))
    be = backend(config=cfg)
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\] would guide nothing.*model.layers.1.mlp.experts"):
        be.set_guided_layers([1, 2])
    be.set_guided_layers([0, 2])
    assert be.guided_sites == {(0, "expert_fc2_in"), (2, "expert_fc2_in")}
    be.set_guided_layers([])
    assert be.guided_sites == set()


@pytest.mark.parametrize("mode, config", [("bf16", FULL_ALL), ("fp4", TraceConfig(guided_sites=()))],
                         ids=["bf16-mode", "no-guided-sites"])
def test_explicit_guided_layers_where_no_site_records_are_refused(mode, config):
    """BF16 mode took ``guided_layer_ids=[1]``: no site recorded, yet its recipe named layer 1 as guided (at every
    guided site). The policy (None: its own rule) and [] (no layer) stay accepted."""
    with pytest.raises(ValueError, match=rf"set_guided_layers\(\[1\]\): mode='{mode}' with guided_sites=.* "
                                         "quantizes no guided site; pass \\[\\] or None"):
        backend(mode=mode, config=config, guided_layer_ids=[1])
    be = backend(mode=mode, config=config, guided_layer_ids=[])
    assert be.guided_sites == set() and be.recipe().guided_layers == ()
    be.set_guided_layers(None)
    assert be.guided_sites == set()


@pytest.mark.parametrize("ids", [2, "1"])
def test_guided_layer_ids_that_are_no_list_are_named(ids):
    """2 was a bare "'int' object is not iterable"; "1" (a string) is no list of layer ids either."""
    with pytest.raises(TypeError, match=rf"guided layer ids {ids!r} must be a list of ints, or None"):
        backend(mode="fp4", config=FULL_ALL, guided_layer_ids=ids)


@pytest.mark.parametrize("kw,err,match", [
    # were: "no" is truthy (prefix_reuse / fused_kv_attention turned on, fast_kv_attention kept as "no"); a dict
    # config a bare AttributeError ('dict' object has no attribute 'enabled')
    (dict(prefix_reuse="no"), ValueError, r"\{'prefix_reuse': 'no'\} must be bools"),
    (dict(fast_kv_attention="no"), ValueError, r"\{'fast_kv_attention': 'no'\} must be bools"),
    (dict(fused_kv_attention=0), ValueError, r"\{'fused_kv_attention': 0\} must be bools \(fused_kv_attention: or "
                                             r"None, the default\)"),
    (dict(config={"format": "nvfp4"}), TypeError, r"trace_config must be a TraceConfig \(TraceConfig.from_dict for "
                                                  r"a dict\), got dict"),
], ids=["prefix_reuse", "fast_kv_attention", "fused_kv_attention", "dict-config"])
def test_flags_and_a_config_of_the_wrong_type_are_named(kw, err, match):
    with pytest.raises(err, match=match):
        backend(**kw)


@pytest.mark.parametrize("config", [TraceConfig(enabled=False), TraceConfig(sites=(), guided_sites=())],
                         ids=["disabled", "no-sites"])
def test_an_fp4_rollout_of_a_config_that_quantizes_nothing_is_refused(config):
    """mode='fp4' with such a config served the model dtype under the FP4 name (no module quantized, no record): the
    demo's fp4_naive arm with trace.enabled=false measured the BF16 floor and reported it as FP4's mismatch."""
    with pytest.raises(ValueError, match=r"mode='fp4' with a TraceConfig that quantizes nothing \(enabled="):
        backend(config=config)
    be = backend(mode="bf16", config=config)  # (BF16 mode ignores the sites)
    out = be.generate(PROMPTS, SamplingParams(max_new_tokens=2, seed=0))
    assert be.module_audit().quantized == () and out.guidance == {}


@pytest.mark.parametrize("mode", ["bf16", "fp4"])
def test_runs_in_bfloat16(mode):
    be = backend(mode=mode, dtype=torch.bfloat16)
    out = be.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    assert torch.isfinite(out.logprobs).all() and out.response_lens.tolist() == [4, 4, 4]
    assert be.model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_explicit_triton_kernel_the_experts_cannot_run_raises(dtype):
    """kernel='triton' on CPU (or a non-bf16 model) silently ran the experts' reference path (bf16 mode, fp32:
    generate returned logprobs -2.739..., those of kernel='auto'), where the FP4 KV cache raises."""
    from megatron_trace.rollout.experts import RolloutNumerics, _fast_path

    hidden = torch.zeros(2, 64, dtype=dtype)
    with pytest.raises(ValueError, match=rf"kernel='triton' cannot run: .*{dtype} hidden states on cpu.*'auto'"):
        _fast_path(RolloutNumerics(layer_of={}, kernel="triton"), hidden)
    assert not _fast_path(RolloutNumerics(layer_of={}, kernel="auto"), hidden)
    assert not _fast_path(RolloutNumerics(layer_of={}, kernel="reference"), hidden)
    with pytest.raises(ValueError, match="kernel='Triton' is not one of"):
        _fast_path(RolloutNumerics(layer_of={}, kernel="Triton"), hidden)
    if dtype == torch.float32:  # (a bf16 model raises earlier, choosing the fused KV attention)
        be = backend(mode="bf16", config=TraceConfig(kernel="triton"), dtype=dtype)
        with pytest.raises(ValueError, match="routed experts"):
            be.generate(PROMPTS, SamplingParams(max_new_tokens=2, seed=0))


def test_expert_weights_are_the_weight_quantizers_codes():
    src = dict(checkpoint_tensors(tiny_model(seed=0)))
    be = backend(seed=0)
    wq = TraceConfig().weight_quantizer()
    for layer in range(3):
        for e in (0, 5):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            want1 = wq.quantize(torch.cat([src[p + "gate_proj.weight"], src[p + "up_proj.weight"]]))
            want2 = wq.quantize(src[p + "down_proj.weight"])
            for want, which in ((want1, "fc1"), (want2, "fc2")):
                got = be.expert_weight_fp4(layer, e, which)
                assert torch.equal(got.codes, want.codes)
                assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
                assert torch.equal(got.global_amax, want.global_amax)
    m = be.model.model.layers[1].mlp.experts
    assert torch.equal(m.gate_up_proj[5], be.expert_weight_fp4(1, 5, "fc1").dequantize(torch.float32))


def test_loads_a_checkpoint_directory_and_rejects_other_models(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ._tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", seed=0)
    p = SamplingParams(max_new_tokens=4, seed=0)
    a = HFRolloutBackend(path, mode="fp4", dtype=torch.float32).generate(PROMPTS, p)
    b = backend(config=TraceConfig(), seed=0).generate(PROMPTS, p)
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.logprobs, b.logprobs)
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(TypeError, match="routed experts"):
        HFRolloutBackend(dense, mode="bf16")


@pytest.mark.parametrize("mode", ["bf16", "fp4"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nonfinite_activations_fail_the_batch_loudly(mode, temperature):
    from megatron_trace.formats import NonFiniteError

    be = backend(mode)
    be.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0, temperature=temperature))  # healthy first
    with torch.no_grad():
        be.model.model.embed_tokens.weight[PROMPTS[2][0]] = float("nan")  # only the third prompt sees it
    with pytest.raises(NonFiniteError, match="NaN|non-finite"):
        be.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0, temperature=temperature))


@pytest.mark.parametrize("amax", ["per_row", "per_tensor"])
@pytest.mark.parametrize("mode", ["compact", "full"])
def test_recorded_bytes_equal_the_planners(amax, mode):
    # the planner sizes what the rollout records: a per-tensor amax is stored on every row of its step
    from megatron_trace.guidance.model_dims import ModelDims
    from megatron_trace.guidance.planner import sample_bytes
    from megatron_trace.guidance.records import split_batch

    cfg = TraceConfig(guided_layers="all", cache_mode=mode, activation_amax=amax)
    out = backend(config=cfg).generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0))
    samples = split_batch(out.guidance, out.tokens, version=0, attention_mask=out.attention_mask)
    dims = ModelDims.from_hf_config(tiny_config().to_dict())
    for s, n in zip(samples, out.attention_mask.sum(1).tolist(), strict=True):
        assert s.guidance_nbytes() == sample_bytes(dims, cfg, n)["guidance"]


@pytest.mark.parametrize("fmt, reuse", [("nvfp4", True), ("mxfp4", False)],
                         ids=["nvfp4-prefix-reuse", "mxfp4-no-reuse"])
def test_a_greedy_sample_is_the_same_in_any_batch(fmt, reuse):
    """Batch invariance (per-row amax, the default; fp32): a greedy sample alone and in a batch of shorter and longer
    prompts, at two positions (its prompt then forked under prefix reuse), beside a row that stops at its first token,
    has the same tokens, routing and guidance bit for bit (codes, scales, valid rows, expert ids: per sample as the
    trainer receives them, token hash and version included); log-probs and NVFP4 per-row amax values within float
    rounding (torch's CPU kernels round batches of 1-2 rows and padding masks differently)."""
    from megatron_trace.guidance.records import pack_guidance, token_hash

    be = backend(config=TraceConfig(format=fmt, guided_layers="all", cache_mode="full"), prefix_reuse=reuse)
    p, early = [5, 6, 7, 8], [8, 9, 10, 11, 12, 13]
    stop = be.generate([early], SamplingParams(max_new_tokens=1, temperature=0)).responses()[0][0]
    sampling = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(stop,))
    prompts = [early, p, [40], p]
    out = be.generate(prompts, sampling)
    assert out.finish_reasons[0] == "stop" and out.response_lens[0] == 1 and out.response_lens[1] > 1

    def samples(batch):
        packed = pack_guidance(batch.guidance, batch.tokens, version=batch.policy_version,
                               attention_mask=batch.attention_mask).to_samples()
        for b, s in enumerate(packed):
            assert s.token_hash == token_hash(batch.tokens[b, : s.num_tokens]) and s.version == be.policy_version
        return packed

    got = samples(out)
    single = {tuple(q): be.generate([q], sampling) for q in prompts}
    for row in range(len(prompts)):
        alone = single[tuple(prompts[row])]
        want = samples(alone)[0]
        n = want.num_tokens
        assert got[row].token_hash == want.token_hash and out.responses()[row] == alone.responses()[0]
        assert torch.allclose(out.logprobs[row, :n], alone.logprobs[0, :n], atol=1e-5)
        for layer, r in alone.routing.items():
            assert torch.equal(out.routing[layer][row, :n], r[0, :n]), (row, layer)
        assert set(got[row].sites) == set(want.sites) == set(out.guidance)
        for key, w in want.sites.items():
            g = got[row].sites[key]
            assert torch.equal(g.valid, w.valid) and (w.expert_ids is None or torch.equal(g.expert_ids, w.expert_ids))
            assert torch.equal(g.record.codes, w.record.codes), (row, key)
            assert torch.equal(g.record.block_scales.view(torch.uint8), w.record.block_scales.view(torch.uint8))
            if fmt == "nvfp4":  # each row's own amax: the rows agree within float rounding of their inputs
                assert torch.allclose(g.record.global_amax, w.record.global_amax, rtol=1e-5, atol=0), (row, key)
            else:
                assert g.record.global_amax is None and w.record.global_amax is None
