"""Launch arguments, guidance specs and weight tensors of the SGLang backend, against independent references.

Runs in the main venv too (no sglang needed)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_trace.bridge.sync import fp4_stream
from megatron_trace.config import TraceConfig
from megatron_trace.export import build_modelopt_state
from megatron_trace.formats import nvfp4
from megatron_trace.manifest import RecipeMismatchError
from megatron_trace.rollout import SamplingParams
from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend
from megatron_trace.rollout.sglang.launch import guidance_specs, kv_cache_dtype, trace_server_args
from megatron_trace.rollout.sglang.weights import engine_tensors

from ..rollout._tiny import tiny_config
from ._common import needs_sglang
from .test_backend_contract import CFG, FC1_ONLY, HF, _Engine, trainer_recipe


def test_response_mask_covers_the_response_positions_only():
    b = SGLangRolloutBackend(_Engine(), FC1_ONLY, HF, kv_cache_dtype="auto").generate(
        [[1, 2, 3], [4]], SamplingParams(max_new_tokens=2))
    assert b.response_mask.tolist() == [[False] * 3 + [True] * 2, [False, True, True, False, False]]


def test_a_bf16_kv_engine_refuses_a_kv_trainer_without_blaming_an_fp4_kv_cache():
    """Only an fp4_e2m1 engine stores K/V as sglang_kvfp4: a BF16-KV engine names the sites, not SGLang's format."""
    with pytest.raises(RecipeMismatchError, match="sites: trainer=") as e:
        SGLangRolloutBackend(None, CFG, HF, recipe=trainer_recipe(CFG), kv_cache_dtype="auto")
    assert "fp4_e2m1" not in str(e.value) and "KV cache format differs" not in str(e.value)


def test_one_kv_site_takes_sglangs_fp4_kv_cache():
    only_k = TraceConfig(sites=("expert_fc1_in", "kv_k", "weights"), guided_sites=("kv_k",))
    assert kv_cache_dtype(only_k) == "fp4_e2m1" and kv_cache_dtype(FC1_ONLY) == "auto"


def test_dense_layers_get_no_expert_specs():
    """A guided layer without routed experts (``mlp_only_layers``) records its K/V only."""
    hf = tiny_config(num_hidden_layers=3, mlp_only_layers=[2]).to_dict()
    specs = {(s.layer, s.site) for s in guidance_specs(CFG, hf, kv_dtype="fp4_e2m1")}
    assert specs == {(1, s) for s in CFG.guided_sites} | {(2, "kv_k"), (2, "kv_v")}


_HYBRID = dict(model_type="qwen3_5_moe_text", vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
               full_attention_interval=2)


@pytest.mark.parametrize("hf", [tiny_config(num_hidden_layers=4, decoder_sparse_step=2).to_dict(), _HYBRID,
                                _HYBRID | {"decoder_sparse_step": 2}],
                         ids=["qwen3-moe-step2", "qwen3.5", "qwen3.5-step"])
@pytest.mark.parametrize("mode", ["compact", "full"])
def test_specs_are_the_sites_and_bytes_accounting_plans(hf, mode):
    """The engine records, per (layer, site) and token, what ``accounting`` sizes from the same config: a hybrid
    model's linear-attention layers (no KV cache) used to get K/V specs, and a Qwen3.5-MoE config's layers with
    experts were picked by Qwen3-MoE's ``decoder_sparse_step`` rule (its transformers model ignores it)."""
    from megatron_trace.guidance.accounting import breakdown, config_fmt_kw
    from megatron_trace.guidance.model_dims import ModelDims

    cfg = TraceConfig(guided_layers="all", cache_mode=mode, kv_format="sglang_kvfp4")
    specs = {s.key: s.nbytes for s in guidance_specs(cfg, hf, kv_dtype="fp4_e2m1")}
    assert specs == breakdown(ModelDims.from_hf_config(hf), cfg.guided_sites, range(4), **config_fmt_kw(cfg))
    kv_only = cfg.replace(guided_layers="explicit", guided_layer_list=(0, 1), guided_sites=("kv_k", "kv_v"))
    if hf["model_type"] == "qwen3_5_moe_text":  # (layer 0 has no KV cache: it recorded nothing, silently)
        with pytest.raises(ValueError, match=r"guided_layer_list has layer\(s\) \[0\], .*KV-cache layers: \[1, 3\]"):
            guidance_specs(kv_only, hf, kv_dtype="fp4_e2m1")


_DATA = Path(__file__).parent.parent / "data"
_OTHER_TREES = {
    "qwen3.5-text": _HYBRID,
    "qwen3.5-wrapped": {"model_type": "qwen3_5_moe", "text_config": _HYBRID},
    "qwen3-next": _HYBRID | {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"] * 2},
    "qwen3.5-35b-like": json.loads((_DATA / "qwen3_5_35b_a3b_like_config.json").read_text()),
    "deepseek-v3": json.loads((_DATA / "deepseek_v3_config.json").read_text()),
    "qwen3-moe-type-next-class": tiny_config().to_dict() | {"architectures": ["Qwen3NextForCausalLM"]},
    "no-type-mla": {k: v for k, v in tiny_config().to_dict().items() if k != "model_type"} | {"kv_lora_rank": 32},
}


@pytest.mark.parametrize("hf", _OTHER_TREES.values(), ids=_OTHER_TREES.keys())
@pytest.mark.parametrize("path", ["trace_server_args", "backend", "module_audit"])
def test_the_sglang_path_refuses_a_model_it_does_not_build_as_qwen3_moe_by_name(hf, path):
    """The SGLang path names Qwen3-MoE's module tree: its capture binds KV slots on ``model.layers.*.self_attn.attn``,
    which SGLang 0.5.10's Qwen3-Next / Qwen3.5-MoE (full attention at ``layers.L.attn``, linear attention at
    ``layers.L.linear_attn.attn``) and DeepSeek-V3 (``self_attn.attn_mqa`` / ``attn_mha``) do not have: the
    engine started and failed at its first forward; the audit listed a K/V cache in every linear-attention layer and
    no expert layer of DeepSeek-V3 (weight sync sent no FP4 expert). Each is refused by its model_type at launch."""
    from megatron_trace.rollout.audit import sglang_module_audit

    mt = hf.get("model_type")
    call = {"trace_server_args": lambda: trace_server_args("/m", CFG, hf, native=False),
            "backend": lambda: SGLangRolloutBackend(None, CFG, hf),
            "module_audit": lambda: sglang_module_audit(CFG, hf, None)}[path]
    with pytest.raises(ValueError, match=rf"model_type={mt!r} .*supports model_type in \['qwen3_moe', 'qwen2_moe'\]"):
        call()


@pytest.mark.parametrize("rule,dense", [({"mlp_only_layers": [2]}, [2]), ({"decoder_sparse_step": 2}, [0, 2])],
                         ids=["mlp-only", "sparse-step"])
@pytest.mark.parametrize("path", ["trace_server_args", "backend"])
def test_the_sglang_path_refuses_dense_layers_that_sglang_builds_with_experts(rule, dense, path):
    """SGLang 0.5.10's Qwen3-MoE / Qwen2-MoE build every layer with routed experts and skip a dense layer's MLP weights
    at load: such a layer was served with uninitialized experts while the trainer ran its dense MLP."""
    hf = tiny_config(num_hidden_layers=4).to_dict() | rule
    call = {"trace_server_args": lambda: trace_server_args("/m", FC1_ONLY, hf, native=False),
            "backend": lambda: SGLangRolloutBackend(None, FC1_ONLY, hf, kv_cache_dtype="auto")}[path]
    with pytest.raises(ValueError, match=rf"makes layer\(s\) {re.escape(str(dense))} dense .* every layer with routed"):
        call()


def test_sglangs_qwen_moe_models_build_every_layer_with_routed_experts():
    """The premise of the refusal above, read from SGLang's source (no import): neither model reads the dense-layer
    fields, both set ``is_layer_sparse = True`` in their decoder layer."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed in this venv")
    for arch in ("qwen3_moe", "qwen2_moe"):
        src = (Path(spec.origin).parent / "srt" / "models" / f"{arch}.py").read_text()
        assert "mlp_only_layers" not in src and "decoder_sparse_step" not in src, arch
        assert "self.is_layer_sparse = True" in src, arch


def test_a_qwen3_moe_config_with_a_stray_hybrid_field_is_served_as_qwen3_moe():
    """transformers' and SGLang's Qwen3-MoE ignore ``full_attention_interval``: every layer keeps its K/V specs."""
    stray = tiny_config(num_hidden_layers=4).to_dict() | {"full_attention_interval": 2}
    assert [s.layer for s in guidance_specs(CFG, stray) if s.site == "kv_k"] == [2, 3]  # (CFG: the deepest half)
    assert trace_server_args("/m", CFG, stray, native=False)["forward_hooks"][0]["target_modules"] == [
        "model.layers.*.self_attn.attn"]


@pytest.mark.parametrize("hf,pattern", [(_HYBRID, "model.layers.0.self_attn.kv_cache"),
                                        (tiny_config(num_hidden_layers=4, decoder_sparse_step=2).to_dict(),
                                         "model.layers.0.mlp.experts")], ids=["linear-attention-kv", "dense-experts"])
def test_specs_refuse_an_exclude_pattern_naming_a_module_the_model_lacks(hf, pattern):
    """Layer 0 has no KV cache (hybrid) / no routed experts (decoder_sparse_step 2): the pattern excluded nothing."""
    cfg = TraceConfig(guided_layers="all", kv_format="sglang_kvfp4", exclude_modules=(pattern,))
    with pytest.raises(ValueError, match=rf"exclude_modules pattern '{re.escape(pattern)}' matches none"):
        guidance_specs(cfg, hf, kv_dtype="fp4_e2m1")


def test_the_emulations_moe_parallel_sizes_are_checked_at_launch_as_its_layers_check_them():
    """SGLang's MoE TP size is tp_size // ep_size // moe_dp_size (``parallel_state``): tp 2 x moe_dp 2 gives whole
    experts per rank, which the emulated MoE quantizes as the trainer does; tp 2 alone shards them and is refused.
    The emulated MoE runs every expert on each rank: ep 2 is refused at launch, not at the engine's model load.
    (No guided layer: guidance capture needs moe_dp_size 1, test_guidance_capture_refuses_context_and_moe_data_...)"""
    fc1 = CFG.replace(sites=("expert_fc1_in", "expert_fc2_in", "weights"), guided_sites=("expert_fc1_in",),
                      guided_layers="none")
    assert trace_server_args("/ckpt", fc1, HF, native=False, tp_size=2, moe_dp_size=2)["moe_dp_size"] == 2
    with pytest.raises(ValueError, match=r"MoE tensor parallel size 1 \(tp_size // moe_dp_size = 1\), got 2"):
        trace_server_args("/ckpt", fc1, HF, native=False, tp_size=2)
    with pytest.raises(ValueError, match=r"supports expert parallel size 1 \(ep_size=1\), got 2"):
        trace_server_args("/ckpt", fc1, HF, native=False, tp_size=2, ep_size=2)
    assert trace_server_args("/ckpt", fc1, HF, native=True, tp_size=2, ep_size=2)["ep_size"] == 2


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("size", [{"ep_size": 0}, {"tp_size": 0}, {"tp_size": -1}, {"moe_dp_size": 0},
                                  {"pp_size": 0}, {"dp_size": -2}, {"tp_size": 2.0}, {"ep_size": True}])
def test_a_parallel_size_below_one_is_refused_by_name(size, native):
    """ep_size=0 divided by zero (a bare ZeroDivisionError) and tp_size 0 / -1 went to SGLang as given, on the native
    path and with no guided layer (nothing compared tp_size with 1 there); every parallel size read is named."""
    cfg = CFG.replace(guided_layers="none")
    assert trace_server_args("/ckpt", cfg, HF, native=native)["kv_cache_dtype"] == "fp4_e2m1"  # (accepted at 1)
    (key, value), = size.items()
    with pytest.raises(ValueError, match=rf"parallel size\(s\) \{{'{key}': {value!r}\}} must be ints >= 1"):
        trace_server_args("/ckpt", cfg, HF, native=native, **size)


def test_engine_tensors_are_the_exported_checkpoint_s():
    """An FP4 expert weight goes to the engine as the tensors ``export.modelopt`` writes for it (ModelOpt's
    ``weight_scale_2`` = amax / 2688, TRACE's exact amax), bit for bit; other tensors in BF16, ints unchanged."""
    g = torch.Generator().manual_seed(0)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    (stream,) = fp4_stream([(name, torch.randn(64, 32, generator=g) * 3)], CFG.weight_quantizer())
    state, _ = build_modelopt_state([stream], 4.0, trace_extras=True)
    got = dict(engine_tensors([stream]))
    assert set(got) == {k for k in state if not k.endswith("input_scale")}
    for k, t in got.items():
        bits = lambda x: x.reshape(-1).view(torch.uint8)  # noqa: E731
        assert t.dtype == state[k].dtype and torch.equal(bits(t), bits(state[k])), k
    ids = torch.arange(5)
    ((_, t),) = engine_tensors([("model.rotary_emb.inv_freq_ids", ids)])
    assert t.dtype == torch.int64 and torch.equal(t, ids)


def test_engine_tensors_refuse_a_per_row_amax():
    """SGLang holds one weight_scale_2 per expert Linear: an FP4 weight with a per-row amax cannot be sent."""
    q = nvfp4.quantize(torch.randn(64, 32), per_row=True)
    with pytest.raises(ValueError, match=r"per-tensor global amax, got nvfp4 amax shape \(64, 1\)"):
        engine_tensors([("model.layers.1.mlp.experts.3.down_proj.weight", q)])


@pytest.mark.parametrize("cfg, kv_dtype", [(CFG, "auto"), (CFG, "bfloat16"), (FC1_ONLY, "fp4_e2m1")],
                         ids=["kv_sites_bf16_auto", "kv_sites_bf16", "no_kv_sites_fp4"])
def test_a_kv_cache_dtype_override_against_the_configs_kv_sites_is_refused_at_launch(cfg, kv_dtype):
    """Such an engine served other K/V than a trainer with the same config computes; only the backend's recipe check
    refused it, once the engine had started. Without the override the config's own KV cache is taken."""
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{kv_dtype}' stores .* K/V, but TraceConfig.sites="):
        trace_server_args("/ckpt", cfg, HF, native=False, kv_cache_dtype=kv_dtype)
    assert trace_server_args("/ckpt", cfg, HF, native=False)["kv_cache_dtype"] == kv_cache_dtype(cfg) != kv_dtype


def _served(cfg: TraceConfig, native: bool = False, **overrides):
    """A stand-in engine holding SGLang's own ``ServerArgs`` as ``trace_server_args`` builds them for ``cfg``
    (``model_path="dummy"``: SGLang resolves nothing device-specific, so they are built on the CPU too)."""
    from sglang.srt.server_args import ServerArgs

    eng = _Engine()
    eng.server_args = ServerArgs(**trace_server_args("dummy", cfg, HF, native=native, **overrides))
    return eng


FC1_GUIDED = FC1_ONLY.replace(guided_sites=("expert_fc1_in",))


@needs_sglang
def test_the_backend_reports_the_kv_cache_the_engine_serves_not_the_one_its_config_implies():
    """An engine launched with another TraceConfig than the backend's: its FP4 K/V were reported as BF16 (the
    backend took its own config's default, ``auto``) and a trainer without KV sites passed the recipe check; its
    BF16 K/V got KV record specs whose read-out failed inside the engine. The engine's ``server_args`` decide."""
    fp4 = _served(CFG)
    assert fp4.server_args.kv_cache_dtype == "fp4_e2m1"
    b = SGLangRolloutBackend(fp4, FC1_ONLY, HF, native=False)
    assert b.kv_cache_dtype == "fp4_e2m1" and b.recipe().kv_format == "sglang_kvfp4"
    assert {f"model.layers.{i}.self_attn.kv_cache" for i in range(3)} <= set(b.module_audit().quantized)
    with pytest.raises(RecipeMismatchError, match=r"kv_format: trainer='none' sglang rollout='sglang_kvfp4'"):
        SGLangRolloutBackend(fp4, FC1_ONLY, HF, native=False, recipe=trainer_recipe(FC1_ONLY))
    bf16 = _served(FC1_GUIDED)
    assert bf16.server_args.kv_cache_dtype == "auto"
    b = SGLangRolloutBackend(bf16, CFG, HF, native=False)
    assert b.kv_cache_dtype == "auto" and not [s for s in b.specs if s.site in ("kv_k", "kv_v")]
    for eng, told, served in ((fp4, "auto", "fp4_e2m1"), (bf16, "fp4_e2m1", "auto")):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{told}' was given, but the engine serves "
                                             rf"kv_cache_dtype='{served}'"):
            SGLangRolloutBackend(eng, FC1_ONLY, HF, native=False, kv_cache_dtype=told)
    assert SGLangRolloutBackend(bf16, FC1_ONLY, HF, native=False, kv_cache_dtype="bf16").kv_cache_dtype == "auto"


@needs_sglang
@pytest.mark.parametrize("guided", [("kv_k",), ("kv_v",), ("expert_fc2_in",)])
def test_an_engine_serving_tensor_parallel_is_refused_for_sharded_guidance(guided):
    """README: ``tp_size=1`` for expert_fc2_in and KV guidance is checked again on the engine's resolved server_args.
    A TP-2 engine (launched for expert_fc1_in guidance, which TP replicates) was accepted by a backend guiding K/V or
    FC2: its read-out of rank 0's shard failed inside the engine, or returned a shard's rows."""
    cfg = CFG.replace(guided_sites=guided)
    eng = _served(cfg.replace(guided_sites=("expert_fc1_in",)), native=True, tp_size=2)  # (the native MoE: any TP)
    with pytest.raises(ValueError, match=rf"guidance for \['{guided[0]}'\] needs tp_size=1 \(got 2\)"):
        SGLangRolloutBackend(eng, cfg, HF, native=True)
    assert SGLangRolloutBackend(eng, cfg.replace(guided_sites=("expert_fc1_in",)), HF, native=True).specs


@needs_sglang
def test_an_engine_without_routed_experts_is_refused_before_sampling_when_the_config_needs_them():
    """An engine launched for a config without routing replay or FC2 guidance returns no routed experts: a backend
    with routing replay was accepted and raised only after each ``generate`` had sampled its batch."""
    no_routing = FC1_GUIDED.replace(routing_replay=False)
    eng = _served(no_routing)
    assert eng.server_args.enable_return_routed_experts is False
    with pytest.raises(ValueError, match=r"routing_replay=True .* enable_return_routed_experts=False \(its server_"):
        SGLangRolloutBackend(eng, FC1_GUIDED, HF, native=False)
    assert not SGLangRolloutBackend(eng, no_routing, HF, native=False).return_routing


@needs_sglang
def test_an_engine_without_the_trace_weight_loader_is_refused_for_in_process_updates():
    """``update_weights`` sends ``load_format=WEIGHT_LOADER``; SGLang's ``ModelRunner.update_weights_from_tensor``
    raises NotImplementedError in the scheduler for a load format not in ``custom_weight_loader``: an engine launched
    without it was accepted and died at the first weight update. An NCCL weights group needs no loader."""
    from megatron_trace.rollout.sglang.launch import WEIGHT_LOADER

    assert _served(FC1_GUIDED).server_args.custom_weight_loader == [WEIGHT_LOADER]
    eng = _served(FC1_GUIDED, custom_weight_loader=[])
    with pytest.raises(ValueError, match=r"custom_weight_loader=\[\] \(its server_args\), without 'megatron_trace"):
        SGLangRolloutBackend(eng, FC1_GUIDED, HF, native=False)
    assert SGLangRolloutBackend(eng, FC1_GUIDED, HF, native=False, weights_group=object()).weights_group is not None


@needs_sglang
@pytest.mark.parametrize("quantization", ["modelopt_fp4", None])
def test_an_engine_serving_another_quantization_is_refused(quantization):
    """A stock ModelOpt (static input scales) or unquantized engine was accepted: its experts round otherwise than
    the backend's recipe says, and its capture buffers, never written by the TRACE method, were read out as rows."""
    eng = _served(FC1_GUIDED, quantization=quantization)
    want = "None" if quantization is None else f"'{quantization}'"
    with pytest.raises(ValueError, match=rf"quantization={want} \(its server_args\), not 'trace_nvfp4'"):
        SGLangRolloutBackend(eng, FC1_GUIDED, HF, native=False)


@needs_sglang
def test_guidance_capture_refuses_data_parallel_replicas():
    """With dp_size > 1 SGLang's ``DataParallelController`` round-robins every request, the read-out too (its
    source below): a read-out reached another replica than the finished request, whose radix cache does not hold
    it. ``dp_size`` 1 is required with guidance, at launch and on the engine's server_args."""
    import ast

    path = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "managers" / "data_parallel_controller.py"
    cls = next(n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == "DataParallelController")
    rr = next(n for n in cls.body if getattr(n, "name", None) == "round_robin_scheduler")
    assert "self.workers[self.round_robin_counter].send_pyobj(req)" in ast.unparse(rr)  # (no routing by prefix)
    assert trace_server_args("/ckpt", FC1_GUIDED, HF, native=False)["dp_size"] == 1
    with pytest.raises(ValueError, match=r"guidance capture needs dp_size=1, got 2: SGLang's data-parallel"):
        trace_server_args("/ckpt", FC1_GUIDED, HF, native=False, dp_size=2)
    eng = _served(FC1_GUIDED)
    eng.server_args.dp_size = 2  # (an engine launched otherwise than trace_server_args launches it)
    with pytest.raises(ValueError, match=r"guidance capture needs dp_size=1, got 2"):
        SGLangRolloutBackend(eng, FC1_GUIDED, HF, native=False)
    assert trace_server_args("/ckpt", FC1_ONLY, HF, native=False, dp_size=2)["dp_size"] == 2  # nothing captured


@needs_sglang
@pytest.mark.parametrize("key", ["attn_cp_size", "moe_dp_size"])
def test_guidance_capture_refuses_context_and_moe_data_parallelism(key):
    """SGLang's Qwen3-MoE splits a prefill's tokens over the attention-CP ranks (``prepare_context_parallel_metadata``
    with ``attn_cp_rank``) and asserts ``attn_cp_size == moe_dp_size``: each rank's MoE sees its share, and the
    read-out returns rank 0's slot buffers. Accepted before; required 1 with guidance, at launch and on the engine."""
    import ast

    path = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "models" / "qwen3_moe.py"
    src = ast.unparse(ast.parse(path.read_text()))
    assert "prepare_context_parallel_metadata(len(input_ids), self.attn_cp_rank, self.attn_cp_size" in src
    assert "self.attn_cp_size == self.moe_dp_size" in src
    assert trace_server_args("/ckpt", FC1_GUIDED, HF, native=False)[key] == 1
    with pytest.raises(ValueError, match=rf"guidance capture needs {key}=1, got 2: "):
        trace_server_args("/ckpt", FC1_GUIDED, HF, native=True, tp_size=2, **{key: 2})
    eng = _served(FC1_GUIDED)
    setattr(eng.server_args, key, 2)  # (an engine launched otherwise than trace_server_args launches it)
    with pytest.raises(ValueError, match=rf"guidance capture needs {key}=1, got 2"):
        SGLangRolloutBackend(eng, FC1_GUIDED, HF, native=False)
    assert trace_server_args("/ckpt", FC1_ONLY, HF, native=True, tp_size=2, **{key: 2})[key] == 2  # nothing captured
