"""The SGLang backend's manifest side without an engine: KV format honesty, exclude_modules, trainer rejection.

Runs in the main venv (no sglang needed); the trainer-side check needs megatron-core (skipped without it)."""

import logging

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.formats import nvfp4, sglang_kvfp4
from megatron_trace.guidance.site import SiteGuidance
from megatron_trace.manifest import (
    ModulePatternError,
    QuantRecipe,
    RecipeMismatchError,
    experts_name,
    kv_cache_name,
    quantized_module_names,
)
from megatron_trace.rollout import HFRolloutBackend
from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend
from megatron_trace.rollout.sglang.launch import guidance_specs
from megatron_trace.rollout.sglang.weights import engine_tensors

from ..rollout._tiny import tiny_config, tiny_model

CFG = TraceConfig(guided_layers="last_k", guided_last_k=2)
HF = {**tiny_config().to_dict(), "dtype": "bfloat16"}  # as an exported config.json: SGLang's "auto" is bf16
LAYERS = range(3)
FC1_ONLY = TraceConfig(sites=("expert_fc1_in", "expert_fc2_in", "weights"), guided_sites=())


def trainer_recipe(config, *, version=0):
    """The trainer's recipe (``manifest.trainer_recipe`` computes the same from ``find_trace_layers``)."""
    return QuantRecipe.from_config(config, guided_layers=(1, 2), weight_version=version,
                                   quantized_modules=quantized_module_names(config, moe_layers=LAYERS,
                                                                            attention_layers=LAYERS))


def test_fp4_kv_engine_refuses_a_kv_quantizing_trainer_unless_accepted(caplog):
    with pytest.raises(RecipeMismatchError, match="sites: trainer=.*kv_k.*sglang_kvfp4"):
        SGLangRolloutBackend(None, CFG, HF, recipe=trainer_recipe(CFG))
    with caplog.at_level(logging.WARNING):
        be = SGLangRolloutBackend(None, CFG, HF, recipe=trainer_recipe(CFG), accept_kv_format_mismatch=True)
    assert "accepted" in caplog.text and be.kv_fp4
    assert {kv_cache_name(i) for i in LAYERS} <= set(be.module_audit().quantized)
    assert {s.fmt for s in be.specs if s.site.startswith("kv_")} == {sglang_kvfp4.NAME}
    # a BF16-KV engine with a KV-quantizing trainer: the plain site check fires
    with pytest.raises(RecipeMismatchError, match="sites: trainer="):
        SGLangRolloutBackend(None, CFG, HF, recipe=trainer_recipe(CFG), kv_cache_dtype="auto")


def test_fp4_kv_engine_accepts_a_trainer_in_sglangs_kv_format(caplog):
    """TraceConfig.kv_format='sglang_kvfp4': the trainer computes what the engine stores; no override needed."""
    sg = CFG.replace(kv_format="sglang_kvfp4")
    with caplog.at_level(logging.WARNING):
        be = SGLangRolloutBackend(None, sg, HF, recipe=trainer_recipe(sg))
        SGLangRolloutBackend(None, CFG, HF, recipe=trainer_recipe(sg))  # the engine stores sglang_kvfp4 anyway
    assert "KV cache format differs" not in caplog.text
    assert be.recipe() == trainer_recipe(sg) and be.recipe().kv_format == sglang_kvfp4.NAME
    with pytest.raises(RecipeMismatchError, match="kv_format: trainer='nvfp4' sglang rollout='sglang_kvfp4'.*"
                                                  "set TraceConfig.kv_format='sglang_kvfp4'"):
        SGLangRolloutBackend(None, sg, HF, recipe=trainer_recipe(CFG))
    with pytest.raises(RecipeMismatchError, match="kv_format: trainer='sglang_kvfp4' sglang rollout='none'"):
        SGLangRolloutBackend(None, sg, HF, recipe=trainer_recipe(sg), kv_cache_dtype="auto")  # BF16 KV engine
    with pytest.raises(RecipeMismatchError, match="weight_version: trainer=0 sglang rollout=1"):
        be.update_weights([], recipe=trainer_recipe(sg))  # every sync is checked, as before


def test_an_fp4_kv_engine_reports_its_kv_caches_whatever_the_config():
    """kv_cache_dtype=fp4_e2m1 named by hand: the engine stores FP4 K/V even where the TraceConfig has no KV site.
    The audit and recipe say so, and a trainer computing BF16 K/V is refused, not accepted."""
    modules = quantized_module_names(FC1_ONLY, moe_layers=LAYERS, attention_layers=LAYERS)
    bf16_kv_trainer = QuantRecipe.from_config(FC1_ONLY, guided_layers=(), weight_version=0, quantized_modules=modules)
    be = SGLangRolloutBackend(None, FC1_ONLY, HF, native=False, kv_cache_dtype="fp4_e2m1")
    assert {kv_cache_name(i) for i in LAYERS} <= set(be.module_audit().quantized)
    assert be.recipe().kv_format == sglang_kvfp4.NAME
    with pytest.raises(RecipeMismatchError, match="kv_format: trainer='none' sglang rollout='sglang_kvfp4'.*"
                                                  "quantized_modules: trainer=.*self_attn.kv_cache"):
        be.check_recipe(bf16_kv_trainer)
    auto = SGLangRolloutBackend(None, FC1_ONLY, HF, native=False, kv_cache_dtype="auto")
    assert not any(m.endswith(".kv_cache") for m in auto.module_audit().quantized) and auto.recipe().kv_format == "none"


@pytest.mark.parametrize("cfg", [TraceConfig(enabled=False), TraceConfig(sites=("kv_k", "kv_v"), guided_sites=()),
                                 FC1_ONLY.replace(sites=("expert_fc1_in", "expert_fc2_in"))],
                         ids=["disabled", "kv_only", "no_weights"])
def test_a_config_that_does_not_quantize_weights_is_refused_by_a_trace_engine(cfg):
    """A TRACE engine serves the NVFP4 checkpoint's expert weights in FP4 whatever the config says. Each of these
    was accepted, its audit and recipe saying BF16 expert weights (a disabled config: nothing quantized), so a
    trainer computing BF16 experts passed the recipe check against FP4 ones."""
    from megatron_trace.rollout.sglang.launch import trace_server_args

    with pytest.raises(ValueError, match=r"does not quantize 'weights', but a TRACE engine .* serves the NVFP4"):
        SGLangRolloutBackend(None, cfg, HF, native=False)
    with pytest.raises(ValueError, match=r"does not quantize 'weights'.*stock SGLang engine"):
        trace_server_args("/ckpt", cfg, HF, native=False)


@pytest.mark.parametrize("kv", ["fp4_e2m1", "auto"])
def test_exclude_modules_audit_matches_hf_backend_and_trainer(kv):
    cfg = CFG.replace(exclude_modules=("model.layers.0.mlp.experts",))
    if kv == "auto":
        cfg = cfg.replace(sites=("expert_fc1_in", "expert_fc2_in", "weights"),
                          guided_sites=("expert_fc1_in", "expert_fc2_in"))
    be = SGLangRolloutBackend(None, cfg, HF, kv_cache_dtype=kv, accept_kv_format_mismatch=True,
                              recipe=trainer_recipe(cfg))
    hf = HFRolloutBackend(tiny_model(), mode="fp4", trace_config=cfg, dtype=torch.float32)
    audit = be.module_audit()
    assert audit.quantized == hf.module_audit().quantized == trainer_recipe(cfg).quantized_modules
    assert experts_name(0) in audit.bf16 and experts_name(0) in hf.module_audit().bf16
    assert be.bf16_expert_layers == hf.bf16_expert_layers == {0}
    assert all(s.layer != 0 or s.site.startswith("kv_") for s in be.specs)
    # flipping the exclusion on the rollout side only: the audit / recipe check fires
    with pytest.raises(RecipeMismatchError, match="quantized_modules"):
        SGLangRolloutBackend(None, CFG.replace(sites=cfg.sites, guided_sites=cfg.guided_sites), HF,
                             kv_cache_dtype=kv, accept_kv_format_mismatch=True, recipe=trainer_recipe(cfg))


def test_native_engine_reports_static_activation_scales():
    cfg = CFG.replace(sites=("expert_fc1_in", "expert_fc2_in", "weights"), guided_sites=("expert_fc1_in",))
    assert SGLangRolloutBackend(None, cfg, HF, native=False, recipe=trainer_recipe(cfg)).recipe() == \
        trainer_recipe(cfg)
    with pytest.raises(RecipeMismatchError, match="activation_amax: trainer='per_row' sglang rollout='static_input"):
        SGLangRolloutBackend(None, cfg, HF, native=True, recipe=trainer_recipe(cfg))


def test_native_engine_refuses_an_nccl_weights_group():
    """update_weights_from_distributed does not re-run the native MoE's post-processing: refused when built."""
    with pytest.raises(ValueError, match="update_weights_from_distributed does not re-derive them"):
        SGLangRolloutBackend(None, CFG, HF, native=True, weights_group=object())
    assert SGLangRolloutBackend(None, CFG, HF, native=False, weights_group=object()).weights_group is not None


def test_exclude_modules_errors():
    with pytest.raises(ModulePatternError, match="model.layers.9"):
        SGLangRolloutBackend(None, CFG.replace(exclude_modules=("model.layers.9.mlp.experts",)), HF)
    with pytest.raises(ValueError, match="quantizes every layer"):
        SGLangRolloutBackend(None, CFG.replace(exclude_modules=("model.layers.0.self_attn.kv_cache",)), HF)
    q = CFG.weight_quantizer().quantize(torch.randn(32, 64))
    with pytest.raises(ValueError, match="keeps layer 0's experts in BF16"):
        engine_tensors([("model.layers.0.mlp.experts.1.down_proj.weight", q)], bf16_layers={0})
    assert engine_tensors([("model.layers.1.mlp.experts.1.down_proj.weight", q)], bf16_layers={0})
    bf16 = ("model.layers.1.mlp.experts.1.down_proj.weight", torch.zeros(64, 32))
    with pytest.raises(ValueError, match="holds layer 1's routed experts as packed NVFP4; send FP4 values"):
        engine_tensors([bf16], bf16_layers={0}, fp4_layers={1, 2})
    assert engine_tensors([bf16, ("model.norm.weight", torch.ones(64))], bf16_layers={1}, fp4_layers={0, 2})


def test_guidance_specs_follow_the_policy_and_kv_dtype():
    specs = guidance_specs(CFG, HF, kv_dtype="fp4_e2m1")
    assert {(s.layer, s.site) for s in specs} == {(i, s) for i in (1, 2) for s in CFG.guided_sites}
    kv = [s for s in specs if s.site == "kv_v"][0]
    assert kv.row_shape == (2, 16) and kv.nbytes == 2 * (16 // 8 + 1)  # compact: 2 B bits + 1 B scale per head
    assert all(not s.site.startswith("kv_") for s in guidance_specs(CFG, HF, kv_dtype="auto"))


def test_trainer_rejects_sglang_kv_records_and_counts_them(caplog):
    pytest.importorskip("megatron.core")
    from megatron_trace.megatron.step import FORMAT, GuidanceFallbackError, check_site

    q = sglang_kvfp4.quantize(torch.randn(2 * 5, 2, 16))
    rec = q.guidance(compact=False)
    rec = type(rec)(codes=rec.codes.reshape(2, 5, 2, 8), block_scales=rec.block_scales.reshape(2, 5, 2, 1),
                    global_amax=None, shape=(2, 5, 2, 16), fmt=rec.fmt)
    sg = SiteGuidance(rec, torch.ones(2, 5, dtype=torch.bool))
    with caplog.at_level(logging.WARNING):
        c = check_site(sg, site="kv_k", layer=1, rows=(2, 16), config=CFG, compact=False, fail=False)
    assert c.sg is None and c.reason == FORMAT and "'sglang_kvfp4' != TraceConfig.format 'nvfp4'" in caplog.text
    with pytest.raises(GuidanceFallbackError, match="sglang_kvfp4"):
        check_site(sg, site="kv_k", layer=1, rows=(2, 16), config=CFG, compact=False, fail=True)
    ok = nvfp4.quantize(torch.randn(2, 5, 2, 16), per_row=True).guidance(compact=False)  # the same rows in nvfp4
    assert check_site(SiteGuidance(ok, sg.valid), site="kv_k", layer=1, rows=(2, 16), config=CFG, compact=False,
                      fail=False).sg is not None


def test_trainer_in_sglangs_kv_format_uses_sglang_kv_records():
    """The same records that a default trainer rejects are accepted with kv_format='sglang_kvfp4', and guided
    rounding toward them reproduces SGLang's codes on the same K."""
    pytest.importorskip("megatron.core")
    from megatron_trace.megatron.step import check_site

    sg_cfg = CFG.replace(kv_format="sglang_kvfp4")
    k = (torch.randn(2, 5, 2, 16) * 3).bfloat16()  # [B, S, kv_heads, head_dim]
    rec = sglang_kvfp4.quantize(k).guidance(compact=False)  # SGLang eager (bf16 math), as its pool stores
    site = SiteGuidance(rec, torch.ones(2, 5, dtype=torch.bool))
    for compact in (False, True):
        c = check_site(site, site="kv_v", layer=1, rows=(2, 16), config=sg_cfg, compact=compact, fail=True)
        assert c.sg is not None and c.reason is None and c.sg.record.fmt == sglang_kvfp4.NAME
        got = sg_cfg.kv_quantizer().guided_quantize(k, c.sg.record)
        assert torch.equal(got.codes, rec.codes) and torch.equal(got.block_scales.view(torch.uint8),
                                                                  rec.block_scales.view(torch.uint8))


def test_sampling_params_map_to_sglangs_with_the_hf_backends_stopping_rule():
    """Generation ends at ``stop_token_ids`` (kept) or ``max_new_tokens``, as in the hf backend (SGLang's ``ignore_eos``
    would skip the stop tokens too: set only without them; test_backend_outputs runs SGLang's finish check)."""
    from megatron_trace.rollout import SamplingParams
    from megatron_trace.rollout.sglang.backend import sampling_dict

    d = sampling_dict(SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5, stop_token_ids=(2,), seed=11))
    assert d == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5, "stop_token_ids": [2],
                 "skip_special_tokens": False, "no_stop_trim": True, "ignore_eos": False, "sampling_seed": 11}
    assert sampling_dict(SamplingParams(seed=2**63 - 1), 3)["sampling_seed"] == 2  # request 3 of a batch
    sgl = pytest.importorskip("sglang.srt.sampling.sampling_params", reason="SGLang's own SamplingParams: its venv")
    p = sgl.SamplingParams(**d)  # every key is one of SGLang's
    assert (p.ignore_eos, p.no_stop_trim, p.max_new_tokens, p.stop_token_ids) == (False, True, 5, {2})
    assert sampling_dict(SamplingParams(max_new_tokens=5))["ignore_eos"] is True  # no stop tokens: EOS ignored


class _Engine:
    """Engine.generate's outputs (SGLang 0.5.10 field names) for 2-token responses; ``finish`` per request.
    ``updates``: the names each ``update_weights_from_tensor`` call received."""

    def __init__(self, finish=None, routed=True, deterministic=True, logprobs=None):
        self.finish, self.routed, self.calls, self.updates = finish or {}, routed, [], []
        self.logprobs = logprobs or {}  # request -> its two tokens' log-probs (else -0.5 each)
        self.server_args = type("ServerArgs", (), {"enable_deterministic_inference": deterministic})()

    def generate(self, input_ids, sampling_params, return_logprob=False, return_routed_experts=False, rid=None):
        import base64

        self.calls.append(sampling_params)
        outs = []
        for i, p in enumerate(input_ids):
            reason = self.finish.get(i, {"type": "length", "length": 2})
            out = [] if (reason["type"] if isinstance(reason, dict) else reason) == "abort" else [5, 6]
            lps = self.logprobs.get(i, [-0.5] * len(out))
            meta = {"finish_reason": reason, "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, out)]}
            if return_routed_experts and self.routed:
                n = len(p) + len(out) - 1
                meta["routed_experts"] = base64.b64encode(torch.zeros(n, 3, 2, dtype=torch.int32).numpy().tobytes())
            outs.append({"output_ids": out, "meta_info": meta})
        return outs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.updates.append([n for n, _ in named_tensors])
        return True, "Succeeded to update parameter online."


def test_seeded_requests_get_distinct_sampling_seeds(caplog):
    """SGLang's seeded sampler draws from (sampling_seed, position) alone: one seed for every request would give
    every copy of a prompt (a GRPO group) the same response."""
    from megatron_trace.rollout import SamplingParams

    eng = _Engine()
    be = SGLangRolloutBackend(eng, FC1_ONLY, HF, kv_cache_dtype="auto")
    be.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=2, seed=7))
    assert [d["sampling_seed"] for d in eng.calls[0]] == [7, 8, 9, 10]
    assert "ignored" not in caplog.text
    be = SGLangRolloutBackend(_Engine(deterministic=False), FC1_ONLY, HF, kv_cache_dtype="auto")
    with caplog.at_level(logging.WARNING):
        be.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=7))
    assert "seed=7 is ignored" in caplog.text and "enable_deterministic_inference" in caplog.text


def test_aborted_request_or_missing_routing_is_an_error():
    """An aborted request (finish_reason type 'abort', e.g. pause_generation(mode='abort')) is no sample, and an
    engine without enable_return_routed_experts returns no routing: both raise instead of passing silently."""
    from megatron_trace.rollout import SamplingParams

    sp = SamplingParams(max_new_tokens=2)
    abort = {"type": "abort", "message": "Abort in waiting queue"}
    be = SGLangRolloutBackend(_Engine({1: abort}), FC1_ONLY, HF, kv_cache_dtype="auto")
    with pytest.raises(RuntimeError, match="request 1 finished with finish_reason=.*abort.*Abort in waiting queue"):
        be.generate([[1, 2], [3, 4]], sp)
    be = SGLangRolloutBackend(_Engine(routed=False), FC1_ONLY, HF, kv_cache_dtype="auto")
    with pytest.raises(RuntimeError, match="request 0 returned no routed_experts.*enable_return_routed_experts"):
        be.generate([[1, 2]], sp)
    b = SGLangRolloutBackend(_Engine(), FC1_ONLY, HF, kv_cache_dtype="auto").generate([[1, 2]], sp)
    assert b.finish_reasons == ("length",) and sorted(b.routing) == [0, 1, 2] and b.response_lens.tolist() == [2]
    b = SGLangRolloutBackend(_Engine(routed=False), FC1_ONLY.replace(routing_replay=False), HF,
                             kv_cache_dtype="auto").generate([[1, 2]], sp)
    assert b.routing == {}


class _RoutedEngine(_Engine):
    """Distinct routing per (request, position, layer, slot): expert (7 * i + 3 * t + layer + k) % 8."""

    def generate(self, input_ids, sampling_params, return_logprob=False, return_routed_experts=False, rid=None):
        import base64

        outs = super().generate(input_ids, sampling_params, return_logprob, return_routed_experts, rid)
        for i, (p, o) in enumerate(zip(input_ids, outs)):
            o["meta_info"]["routed_experts"] = base64.b64encode(_routing(i, len(p) + len(o["output_ids"]) - 1)
                                                                .int().numpy().tobytes())
        return outs


def _routing(i, n):
    t, layer, k = torch.meshgrid(torch.arange(n), torch.arange(3), torch.arange(2), indexing="ij")
    return (7 * i + 3 * t + layer + k) % 8  # [n, layers, topk]


def test_routing_lands_at_the_position_that_routed_it():
    """meta_info["routed_experts"] row t is the routing of the token at position t (SGLang records every forwarded
    token; the last sampled one is never forwarded): RolloutBatch.routing[layer][i, t] for t < len - 1, zeros after,
    per request of any length."""
    from megatron_trace.rollout import SamplingParams

    prompts = [[1, 2, 3, 4], [5, 6]]
    b = SGLangRolloutBackend(_RoutedEngine(), FC1_ONLY, HF, kv_cache_dtype="auto").generate(
        prompts, SamplingParams(max_new_tokens=2))
    for i, p in enumerate(prompts):
        n = len(p) + 2
        want = _routing(i, n - 1)
        for layer in range(3):
            assert torch.equal(b.routing[layer][i, : n - 1], want[:, layer]), (i, layer)
            assert not b.routing[layer][i, n - 1 :].any(), (i, layer)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_log_probs_are_an_error_naming_the_requests(value):
    """NaN/Inf log-probs from the engine (NaN activations or weights inside it) would reach the importance ratio
    and the policy loss: nothing of the batch is returned, as the hf backend does for NaN/Inf logits."""
    from megatron_trace.formats import NonFiniteError
    from megatron_trace.rollout import SamplingParams

    sp = SamplingParams(max_new_tokens=2)
    be = SGLangRolloutBackend(_Engine(logprobs={1: [-0.1, value], 3: [value, -0.2]}), FC1_ONLY, HF,
                              kv_cache_dtype="auto")
    with pytest.raises(NonFiniteError, match=r"NaN/Inf log-probs for 2 of 4 request\(s\) \(first: \[1, 3\]\)"):
        be.generate([[1, 2]] * 4, sp)
    b = SGLangRolloutBackend(_Engine(logprobs={0: [-1e30, -0.0]}), FC1_ONLY, HF, kv_cache_dtype="auto").generate(
        [[1, 2]], sp)
    assert torch.equal(b.logprobs[0, 2:], torch.tensor([-1e30, -0.0]))  # very unlikely, still finite


@pytest.mark.parametrize("key, why", [("enable_hierarchical_cache", "HiCache"), ("enable_lmcache", "LMCache")])
def test_guidance_capture_refuses_a_cache_that_loads_prefixes_into_new_slots(key, why):
    """HiCache (sglang#26975) and LMCache (``LMCRadixCache.match_prefix``) load a stored prefix back into new KV
    slots; the slot buffers of the expert rows do not follow it, so the read-out would return the rows of whatever
    token held those slots before, as valid rows. The capture needs both off; without guidance the engine may use
    them."""
    from megatron_trace.rollout.sglang.launch import REQUIRED, trace_server_args

    assert trace_server_args("/ckpt", CFG, HF, native=False)[key] is False and key in REQUIRED
    with pytest.raises(ValueError, match=f"{key}=False, got True: {why}"):
        trace_server_args("/ckpt", CFG, HF, native=False, **{key: True})
    off = CFG.replace(guided_layers="none")  # nothing captured: nothing to refuse
    assert trace_server_args("/ckpt", off, HF, native=False, **{key: True})[key] is True


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_guidance_capture_refuses_a_disaggregated_engine(mode):
    """A prefill engine decodes nothing (its read-out has no response rows) and a decode engine runs without the radix
    cache the read-out hits (SGLang sets ``disable_radix_cache``): prefill-decode disaggregation is refused by name."""
    from megatron_trace.rollout.sglang.launch import trace_server_args

    assert trace_server_args("/ckpt", CFG, HF, native=False)["disaggregation_mode"] == "null"
    with pytest.raises(ValueError, match=f"disaggregation_mode='null', got '{mode}': a prefill engine"):
        trace_server_args("/ckpt", CFG, HF, native=False, disaggregation_mode=mode)


@pytest.mark.parametrize("key, value", [("disable_radix_cache", True), ("page_size", 64), ("enable_lmcache", True),
                                        ("disaggregation_mode", "prefill"), ("disaggregation_mode", "decode")])
def test_an_engine_resolved_otherwise_than_the_capture_needs_is_refused_by_name(key, value):
    """SGLang's ``ServerArgs.__post_init__`` overrides what ``trace_server_args`` asked: ``disable_radix_cache=True``
    for ``disaggregation_mode="decode"`` or deterministic inference on a backend without radix support, ``page_size=64``
    for the trtllm_mha attention backend (Blackwell's default). The backend checks ``REQUIRED`` on the engine's
    resolved ``server_args``, not only on the kwargs; without guidance it has nothing to check."""
    eng = _Engine()
    setattr(eng.server_args, key, value)
    want = dict(disable_radix_cache=False, page_size=1, enable_lmcache=False, disaggregation_mode="null")[key]
    with pytest.raises(ValueError, match=rf"guidance capture needs {key}={want!r}, got {value!r}: "):
        SGLangRolloutBackend(eng, CFG, HF, native=False)
    SGLangRolloutBackend(eng, CFG.replace(guided_layers="none"), HF, native=False)
    setattr(eng.server_args, key, want)
    SGLangRolloutBackend(eng, CFG, HF, native=False)
    if key == "page_size":  # the override's cause, and the way out, are named
        eng.server_args.page_size, eng.server_args.attention_backend = 64, "trtllm_mha"
        with pytest.raises(ValueError, match="trtllm_mha attention backend, its default on Blackwell.*"
                                             "pass attention_backend='flashinfer' or 'triton'"):
            SGLangRolloutBackend(eng, CFG, HF, native=False)


def test_server_args_ask_for_routing_and_a_kv4_attention_backend():
    """Routing replay needs the engine to return routed experts, and SGLang's FP4 KV cache one of its KV4 MHA
    backends; the backend checks the former only after a generate, the latter nowhere."""
    from megatron_trace.rollout.sglang.launch import trace_server_args

    kw = trace_server_args("/ckpt", CFG, HF, native=False)
    assert kw["enable_return_routed_experts"] is True and kw["kv_cache_dtype"] == "fp4_e2m1"
    assert kw["attention_backend"] == "triton" and kw["quantization"] == "trace_nvfp4"
    kw = trace_server_args("/ckpt", FC1_ONLY.replace(routing_replay=False), HF, native=False)
    assert kw["enable_return_routed_experts"] is False and "attention_backend" not in kw
    # a TP rank holds a shard of the KV heads (and of the FFN): KV / fc2 guidance needs tp_size 1, fc1 alone not
    for sites in (("kv_k",), ("kv_v",), ("expert_fc2_in",)):
        with pytest.raises(ValueError, match=rf"guidance for \['{sites[0]}'\] needs tp_size=1 \(got 2\)"):
            trace_server_args("/ckpt", CFG.replace(guided_sites=sites), HF, native=True, tp_size=2)
    assert trace_server_args("/ckpt", CFG.replace(guided_sites=("expert_fc1_in",)), HF, native=True,
                             tp_size=2)["tp_size"] == 2


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_is_refused_not_reported_as_bf16(kv):
    """SGLang's FP8 KV cache (sglang#25790, NeMo-RL#3225) has no trainer site, recipe field or records: the backend
    used to report such an engine's KV caches as BF16 and accept a BF16-KV trainer, an unrecorded mismatch."""
    from megatron_trace.rollout.sglang.launch import trace_server_args

    with pytest.raises(ValueError, match=f"kv_cache_dtype='{kv}': the trainer has no site for it"):
        trace_server_args("/ckpt", FC1_ONLY, HF, native=False, kv_cache_dtype=kv)
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{kv}'.*valid: .*'auto'"):
        SGLangRolloutBackend(None, FC1_ONLY, HF, native=False, kv_cache_dtype=kv)
    eng = _Engine()
    eng.server_args.kv_cache_dtype = kv  # launched with FP8 KV, the backend not told
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{kv}'"):
        SGLangRolloutBackend(eng, FC1_ONLY, HF, native=False)
    for ok in ("auto", "bf16"):  # BF16 K/V: what a trainer without KV sites computes
        assert trace_server_args("/ckpt", FC1_ONLY, HF, native=False, kv_cache_dtype=ok)["kv_cache_dtype"] == ok
        assert SGLangRolloutBackend(None, FC1_ONLY, HF, native=False, kv_cache_dtype=ok).kv_cache_dtype == ok


def test_without_sglang_the_engine_entry_points_name_the_extra():
    """``launch_rollout.py serve`` on a machine without SGLang: an ImportError naming the extra to install."""
    import importlib.util

    from megatron_trace.rollout.sglang.launch import make_engine, register

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    for call in (lambda: register(CFG), lambda: make_engine(CFG, model_path="/ckpt")):
        with pytest.raises(ImportError, match=r"pip install 'megatron_trace\[sglang\]'"):
            call()


class _Group:
    """Stands in for ``WeightsUpdateGroup`` (SGLang's ``update_weights_from_distributed``)."""

    def __init__(self):
        self.updates = []

    def send(self, named, *, flush_cache=True):
        self.updates.append([n for n, _ in named])


@pytest.mark.parametrize("path", ["tensor", "group"])
def test_an_update_at_or_below_the_engines_version_reaches_no_engine(path):
    """The version is checked before any weight goes to the engine (in place there: nothing to roll back)."""
    cfg = CFG.replace(kv_format="sglang_kvfp4")
    engine, group = _Engine(), _Group()
    sink = engine if path == "tensor" else group
    be = SGLangRolloutBackend(engine, cfg, HF, native=False, weights_group=group if path == "group" else None,
                              recipe=trainer_recipe(cfg))
    norm = [("model.norm.weight", torch.ones(64))]
    be.update_weights(norm, version=3, recipe=trainer_recipe(cfg, version=3))
    assert be.policy_version == 3 and len(sink.updates) == 1
    for stale in (3, 0):
        with pytest.raises(ValueError, match=rf"version={stale} is not newer than the rollout's policy_version=3: "
                                             r"a weight update's version must be strictly greater \(> 3"):
            be.update_weights(norm, version=stale, recipe=trainer_recipe(cfg, version=stale))
    assert be.policy_version == 3 and len(sink.updates) == 1 and be.trainer_recipe == trainer_recipe(cfg, version=3)
    be.update_weights(norm, recipe=trainer_recipe(cfg, version=4))  # None: the next version
    be.update_weights(norm, version=1, reset=True, recipe=trainer_recipe(cfg, version=1))  # a checkpoint, on purpose
    assert be.policy_version == 1 and sink.updates == [["model.norm.weight"]] * 3
    assert engine.updates == [] or path == "tensor"


@pytest.mark.parametrize("path", ["tensor", "group"])
def test_every_weight_update_flushes_the_engines_radix_cache(path):
    """USER_NEEDS §8 (RLinf#96, pytorch/rl#4016): a prefix cached under the old weights would keep serving their KV,
    and the guidance read-out (a radix-cache hit) their rows, after an update. The tensor path asks SGLang to flush;
    the group path leaves ``WeightsUpdateGroup.send``'s default, which flushes (test_weight_sync.py)."""
    flushes = []

    class Engine(_Engine):
        def update_weights_from_tensor(self, named_tensors, load_format=None, **kw):
            flushes.append(kw.get("flush_cache", "default"))
            return super().update_weights_from_tensor(named_tensors, load_format)

    class Group(_Group):
        def send(self, named, **kw):
            flushes.append(kw.get("flush_cache", "default"))
            super().send(named)

    cfg = CFG.replace(kv_format="sglang_kvfp4")
    be = SGLangRolloutBackend(Engine(), cfg, HF, native=False, weights_group=Group() if path == "group" else None,
                              recipe=trainer_recipe(cfg))
    norm = [("model.norm.weight", torch.ones(64))]
    be.update_weights(norm, recipe=trainer_recipe(cfg, version=1))
    be.update_weights(norm, version=0, reset=True, recipe=trainer_recipe(cfg, version=0))
    assert flushes == ([True, True] if path == "tensor" else ["default", "default"])


class _FailingEngine(_Engine):
    """An engine whose next ``update_weights_from_tensor`` fails as SGLang reports it: ``(False, message)``, or by
    raising (the scheduler died mid-load)."""

    def __init__(self):
        super().__init__()
        self.fail: str | None = None

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        fail, self.fail = self.fail, None
        if fail == "raise":
            raise ConnectionError("scheduler process exited")
        if fail == "false":
            return False, "Failed to update weights: shape mismatch in layer 2"
        return super().update_weights_from_tensor(named_tensors, load_format, flush_cache)


@pytest.mark.parametrize("how", ["false", "raise"])
def test_an_update_that_fails_in_the_engine_blocks_generate_until_one_succeeds(how):
    """SGLang loads in place with no rollback: after a failed load some tensors may be new under the old version.
    Before, the backend raised once and then sampled that mixed model as policy_version; now generate refuses
    (naming the failed version) until a full update succeeds, and the version and recipe stay the old ones."""
    from megatron_trace.rollout import SamplingParams

    cfg = CFG.replace(kv_format="sglang_kvfp4")
    eng = _FailingEngine()
    be = SGLangRolloutBackend(eng, cfg, HF, native=False, recipe=trainer_recipe(cfg))
    norm = [("model.norm.weight", torch.ones(64))]
    be.update_weights(norm, version=1, recipe=trainer_recipe(cfg, version=1))
    eng.fail = how
    with pytest.raises((RuntimeError, ConnectionError), match="shape mismatch in layer 2|scheduler process exited"):
        be.update_weights(norm, version=2, recipe=trainer_recipe(cfg, version=2))
    assert be.policy_version == 1 and be.trainer_recipe == trainer_recipe(cfg, version=1)
    assert "version 2 failed in the engine" in be.failed_update
    sp = SamplingParams(max_new_tokens=2)
    n_calls = len(eng.calls)
    with pytest.raises(RuntimeError, match="update to version 2 failed in the engine .*policy_version=1.*send the "
                                           "full weights again"):
        be.generate([[1, 2]], sp)
    assert len(eng.calls) == n_calls  # nothing was sampled
    be.update_weights(norm, version=2, recipe=trainer_recipe(cfg, version=2))  # the retry
    assert be.failed_update is None and be.policy_version == 2
    assert be.generate([[1, 2]], sp).policy_version == 2


def test_after_a_failed_update_generate_waits_for_every_tensor_of_it_again():
    """An update that succeeds but sends only part of the failed one's tensors (none, here) leaves the rest as the
    failed load left them: it used to lift the block, and the mixed engine sampled under the new version."""
    from megatron_trace.rollout import SamplingParams

    cfg = CFG.replace(kv_format="sglang_kvfp4")
    eng = _FailingEngine()
    be = SGLangRolloutBackend(eng, cfg, HF, native=False)
    norm, embed = ("model.norm.weight", torch.ones(64)), ("model.embed_tokens.weight", torch.ones(128, 64))
    be.update_weights([norm, embed], version=1)
    eng.fail = "false"
    with pytest.raises(RuntimeError, match="shape mismatch"):
        be.update_weights([norm, embed], version=2)
    sp = SamplingParams(max_new_tokens=2)
    for sent, left in (([], 2), ([norm], 1)):
        be.update_weights(sent)
        with pytest.raises(RuntimeError, match=rf"{left} tensor\(s\) of the failed update not sent since, e\.g\. "
                                               r"\['model\.embed_tokens\.weight'"):
            be.generate([[1, 2]], sp)
    be.update_weights([embed])
    assert be.failed_update is None and be.generate([[1, 2]], sp).policy_version == 4


@pytest.mark.parametrize("case", ["nan", "beyond_bf16", "fp4_scale"])
def test_an_update_holding_nan_or_inf_reaches_no_engine(case):
    """The hf backend refuses NaN/Inf weights; this one sent them (and float64/float32 values beyond BF16's range,
    Inf after the cast) into the engine, which loads whatever it gets, and moved to the new version."""
    cfg = CFG.replace(kv_format="sglang_kvfp4")
    eng = _Engine()
    be = SGLangRolloutBackend(eng, cfg, HF, native=False)
    name, value = "model.layers.1.self_attn.q_proj.weight", torch.ones(64, 64)
    if case == "nan":
        value[3, 5] = float("nan")
    elif case == "beyond_bf16":
        value = value.double() * 1e39
    else:
        name = "model.layers.0.mlp.experts.1.down_proj.weight"
        value = cfg.weight_quantizer().quantize(torch.randn(64, 32))
        value.block_scales.view(torch.uint8)[0, 0] = 0x7F  # E4M3 NaN
    with pytest.raises(ValueError, match=rf"1 tensor\(s\) hold NaN/Inf as the engine would load them .*\['{name}"):
        be.update_weights([("model.norm.weight", torch.ones(64)), (name, value)])
    assert eng.updates == [] and be.policy_version == 0 and be.failed_update is None
