"""Megatron GPTModel <-> HF Qwen3-MoE (world size 1; EP=2 in test_expert_parallel.py)."""

import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from megatron_trace.bridge.config import transformer_config_from_hf
from megatron_trace.bridge.sync import sync_weights
from megatron_trace.config import TraceConfig
from megatron_trace.rollout import HFRolloutBackend

from ..rollout._tiny import save_tiny_checkpoint, tiny_config
from ._megatron_cpu import megatron_logits

pytestmark = pytest.mark.usefixtures("megatron_world1")


def _disk(path):
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "hf"
    return save_tiny_checkpoint(path, tiny_config(norm_topk_prob=request.param), seed=3)


def _bridge(path, dtype=torch.float32):
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge

    return Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=dtype)


def test_transformer_config_router_settings():
    c = transformer_config_from_hf(tiny_config(norm_topk_prob=True), dtype=torch.float32)
    assert (c.moe_router_score_function, c.moe_router_pre_softmax, c.moe_router_topk) == ("softmax", False, 2)
    assert c.moe_router_load_balancing_type == "none" and c.moe_aux_loss_coeff == 0.0
    assert (c.num_query_groups, c.kv_channels, c.moe_ffn_hidden_size, c.num_moe_experts) == (2, 16, 32, 8)
    assert c.qk_layernorm and c.gated_linear_unit and c.normalization == "RMSNorm" and not c.add_bias_linear
    assert transformer_config_from_hf(tiny_config(norm_topk_prob=False)).moe_router_pre_softmax
    c = transformer_config_from_hf(tiny_config(), load_balancing="aux_loss", expert_parallel=2)
    assert c.moe_aux_loss_coeff > 0 and c.expert_model_parallel_size == 2
    with pytest.raises(NotImplementedError, match="dense"):
        transformer_config_from_hf(tiny_config(mlp_only_layers=[0]))
    with pytest.raises(NotImplementedError, match="attention_bias=True"):  # o_proj.bias would be dropped
        transformer_config_from_hf(tiny_config(attention_bias=True))
    with pytest.raises(NotImplementedError, match="hidden_act='gelu'"):  # the MLPs would run silu
        transformer_config_from_hf(tiny_config(hidden_act="gelu"))
    # top-1 renormalised is a weight of 1.0 (Megatron asked for pre-softmax, whose weight is the probability)
    with pytest.raises(NotImplementedError, match="num_experts_per_tok=1 with norm_topk_prob=True"):
        transformer_config_from_hf(tiny_config(num_experts_per_tok=1, norm_topk_prob=True))
    c = transformer_config_from_hf(tiny_config(num_experts_per_tok=1, norm_topk_prob=False))
    assert (c.moe_router_topk, c.moe_router_pre_softmax) == (1, True)


def test_hf_checkpoint_gives_transformers_logits(ckpt):
    from megatron_trace.bridge import load_hf_checkpoint

    bridge = _bridge(ckpt)
    model = bridge.build_model().eval()
    stats = load_hf_checkpoint(model, ckpt, bridge)
    disk = _disk(ckpt)
    assert stats.tensors == len(disk) and stats.bytes == sum(t.numel() * t.element_size() for t in disk.values())
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
    got = megatron_logits(model, tokens)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("overrides", [dict(rope_theta=1e6), dict(head_dim=32)], ids=["rope_theta", "head_dim"])
def test_a_non_default_rope_theta_or_head_dim_gives_transformers_logits(tmp_path, overrides):
    """Qwen3-MoE releases use rope_theta=1e6; the tiny config's 1e4 is also Megatron's default, so a bridge that
    dropped the checkpoint's theta passed every other test while rotating every query and key by other angles. Their
    head_dim is not hidden_size / num_attention_heads either (Qwen3-30B-A3B: 128, not 2048 / 32 = 64), as the tiny
    config's 16 = 64 / 4 is: a bridge that derived kv_channels from the hidden size passed the other tests."""
    from megatron_trace.bridge import load_hf_checkpoint
    from megatron_trace.bridge.config import gpt_model_kwargs, rope_theta

    cfg = tiny_config(**overrides)
    if "rope_theta" in overrides:
        assert rope_theta(cfg) == 1e6 and gpt_model_kwargs(cfg)["rotary_base"] == 1e6
    else:
        assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    path = save_tiny_checkpoint(tmp_path / "hf", cfg, seed=4)
    bridge = _bridge(path)
    model = bridge.build_model().eval()
    load_hf_checkpoint(model, path, bridge)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
    got = megatron_logits(model, tokens)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


def test_transformer_config_takes_the_hf_fields_and_the_callers_overrides():
    """Fields the tiny checkpoints leave at Megatron's defaults (a bridge that dropped them passed the logits tests);
    the precision flags follow the dtype; sequence parallelism follows TP (the trainer's step shards the sequence by
    ``config.sequence_parallel``); the caller's overrides win, through the bridge too."""
    from megatron_trace.bridge import Qwen3MoeBridge
    from megatron_trace.bridge.config import gpt_model_kwargs

    cfg = tiny_config(rms_norm_eps=1e-3, attention_dropout=0.1, initializer_range=0.05, max_position_embeddings=512)
    c = transformer_config_from_hf(cfg, dtype=torch.float32)
    assert (c.layernorm_epsilon, c.attention_dropout, c.init_method_std) == (1e-3, 0.1, 0.05)
    assert gpt_model_kwargs(cfg)["max_sequence_length"] == 512
    for dtype, bf16, fp16 in ((torch.bfloat16, True, False), (torch.float16, False, True),
                              (torch.float32, False, False)):
        c = transformer_config_from_hf(cfg, dtype=dtype)
        assert (c.params_dtype, c.bf16, c.fp16) == (dtype, bf16, fp16)
    assert not transformer_config_from_hf(cfg).sequence_parallel
    c = transformer_config_from_hf(cfg, tensor_parallel=2)
    assert c.sequence_parallel and c.tensor_model_parallel_size == 2
    c = transformer_config_from_hf(cfg, hidden_dropout=0.1, expert_tensor_parallel_size=2)
    assert (c.hidden_dropout, c.expert_tensor_parallel_size) == (0.1, 2)
    assert Qwen3MoeBridge(cfg, dtype=torch.float32, hidden_dropout=0.1).config.hidden_dropout == 0.1


def test_the_bridge_config_follows_its_parallel_states():
    """The bridge's TransformerConfig has the TP / EP sizes of its parallel states (Megatron's modules shard by the
    parallel state, so a config that said TP 1 under TP 2 still gave the right logits, with sequence parallelism off
    where the trainer's step expects it on); pipeline parallelism is refused by the load and the export."""
    from mbridge.core.parallel_states import ParallelStates

    from megatron_trace.bridge import Qwen3MoeBridge

    c = Qwen3MoeBridge(tiny_config(), dtype=torch.float32, parallel_states=ParallelStates(tp_size=2, ep_size=4)).config
    assert (c.tensor_model_parallel_size, c.sequence_parallel, c.expert_model_parallel_size) == (2, True, 4)
    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.float32, parallel_states=ParallelStates(pp_size=2))
    with pytest.raises(NotImplementedError, match="pipeline parallel size 1 only, got 2"):
        bridge.load_weights([], "unused")
    with pytest.raises(NotImplementedError, match="pipeline parallel size 1 only, got 2"):
        next(bridge.export_weights([]))


@pytest.mark.parametrize("overrides, match", [
    (dict(decoder_sparse_step=2), "dense"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 64}), "rope_type='yarn'"),
    (dict(sliding_window=16, use_sliding_window=True), "sliding-window"),
], ids=["decoder_sparse_step", "yarn", "sliding_window"])
def test_unmapped_variants_are_refused(overrides, match):
    """Each would build a model that computes otherwise than transformers (dense layers, scaled or windowed
    attention) without a word."""
    with pytest.raises(NotImplementedError, match=match):
        transformer_config_from_hf(tiny_config(**overrides))
    transformer_config_from_hf(tiny_config(sliding_window=16, use_sliding_window=False))  # the window unused: fine
    other = tiny_config()
    other.model_type = "qwen3"
    with pytest.raises(ValueError, match="model_type='qwen3': this bridge maps 'qwen3_moe' only"):
        transformer_config_from_hf(other)


@pytest.mark.parametrize("override", [
    dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), dict(moe_router_topk=3),
    dict(moe_router_pre_softmax=True), dict(moe_router_topk_scaling_factor=2.0), dict(num_query_groups=4),
    dict(moe_shared_expert_intermediate_size=32), dict(layernorm_epsilon=1e-5), dict(mtp_num_layers=1),
], ids=lambda o: next(iter(o)))
def test_an_override_that_changes_the_model_is_refused_when_built(override):
    """Sigmoid routing with an expert bias was accepted and failed only at the first export (mbridge's
    NotImplementedError: Qwen3-MoE has no HF tensor for the bias); a top-k, a router or a shape override trained a
    model that the checkpoint, its export and the rollout do not compute, with no error at all. MTP layers, which
    Qwen3-MoE has no tensors for: the bridge built no MTP block, and Megatron's forward took the second half of the
    decoder's sequence as MTP states (an IndexError with labels, an AttributeError without)."""
    from megatron_trace.bridge import Qwen3MoeBridge

    key = next(iter(override))
    with pytest.raises(ValueError, match=rf"config override\(s\) {key}=.*\(this config: .*change what the model"):
        transformer_config_from_hf(tiny_config(), **override)
    with pytest.raises(ValueError, match=rf"{key}="):
        Qwen3MoeBridge(tiny_config(), dtype=torch.float32, **override)
    same = transformer_config_from_hf(tiny_config(), moe_router_topk=tiny_config().num_experts_per_tok)
    assert same.moe_router_topk == tiny_config().num_experts_per_tok  # restating the model's own value: fine


def test_build_gpt_model_uses_the_spec_it_is_given():
    """The RL trainer passes its own (TRACE) layer spec; the model must be built from it, not from the local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_trace.bridge import build_gpt_model

    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False, qk_layernorm=False, normalization="RMSNorm")
    names = [n for n, _ in build_gpt_model(tiny_config(), dtype=torch.float32, spec=spec).named_parameters()]
    assert names and not [n for n in names if "q_layernorm" in n]
    names = [n for n, _ in build_gpt_model(tiny_config(), dtype=torch.float32).named_parameters()]
    assert [n for n in names if "q_layernorm" in n]


def test_build_gpt_model_ties_the_output_layer_as_the_config_says():
    """The RL trainer builds its model with ``build_gpt_model``: a tied config must give a tied output layer (else
    training updates lm_head and the embedding apart, and the exported lm_head is not the one served)."""
    from megatron_trace.bridge import build_gpt_model

    for tied in (True, False):
        model = build_gpt_model(tiny_config(tie_word_embeddings=tied), dtype=torch.float32)
        assert model.share_embeddings_and_output_weights is tied
        assert (model.output_layer.weight is None) is tied  # tied: the output layer reads the embedding's weight


def test_name_and_layout_map(ckpt):
    """Every Megatron tensor equals its independently assembled HF counterpart."""
    from megatron_trace.bridge import load_hf_checkpoint

    bridge = _bridge(ckpt)
    model = bridge.build_model()
    stats = load_hf_checkpoint(model, ckpt, bridge, memory_efficient=True)  # one tensor at a time
    disk, cfg = _disk(ckpt), tiny_config()
    assert stats.tensors == len(disk) and set(bridge.local_hf_names(model)) == set(disk)
    kv, hd, h = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    expected = {"embedding.word_embeddings.weight": disk["model.embed_tokens.weight"],
                "output_layer.weight": disk["lm_head.weight"],
                "decoder.final_layernorm.weight": disk["model.norm.weight"]}
    for L in range(cfg.num_hidden_layers):
        hf, mg = f"model.layers.{L}.", f"decoder.layers.{L}."
        q, k, v = (disk[hf + f"self_attn.{n}_proj.weight"] for n in "qkv")
        expected.update({
            mg + "input_layernorm.weight": disk[hf + "input_layernorm.weight"],
            mg + "pre_mlp_layernorm.weight": disk[hf + "post_attention_layernorm.weight"],
            mg + "self_attention.linear_qkv.weight": torch.cat(
                [q.view(kv, -1, h), k.view(kv, hd, h), v.view(kv, hd, h)], 1).reshape(-1, h),
            mg + "self_attention.q_layernorm.weight": disk[hf + "self_attn.q_norm.weight"],
            mg + "self_attention.k_layernorm.weight": disk[hf + "self_attn.k_norm.weight"],
            mg + "self_attention.linear_proj.weight": disk[hf + "self_attn.o_proj.weight"],
            mg + "mlp.router.weight": disk[hf + "mlp.gate.weight"],
        })
        for e in range(cfg.num_experts):
            x = f"{hf}mlp.experts.{e}."
            expected[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat(
                [disk[x + "gate_proj.weight"], disk[x + "up_proj.weight"]])
            expected[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] = disk[x + "down_proj.weight"]
    state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    assert state.keys() == expected.keys()
    bad = [k for k in state if not torch.equal(state[k], expected[k])]
    assert not bad


def test_megatron_hf_megatron_round_trip_is_bit_exact(tmp_path):
    from megatron_trace.bridge import Qwen3MoeBridge, export_hf_weights, load_hf_checkpoint, save_hf_checkpoint

    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.bfloat16)
    torch.manual_seed(7)
    src = bridge.build_model()
    exported = list(export_hf_weights(src, bridge))
    names = [n for n, _ in exported]
    assert [n for n, _ in export_hf_weights((src,), bridge)] == names  # a tuple of models is a list of them
    assert len(names) == len(set(names)) and "model.layers.2.mlp.experts.7.up_proj.weight" in names
    # in the bridge's dtype, norms included (Megatron's torch RMSNorm keeps its weight in fp32)
    assert src.decoder.final_layernorm.weight.dtype == torch.float32
    assert {t.dtype for _, t in exported} == {torch.bfloat16}
    save_hf_checkpoint(src, tmp_path / "hf", bridge)
    dst = bridge.build_model()
    load_hf_checkpoint(dst, tmp_path / "hf", bridge)
    a, b = src.state_dict(), dst.state_dict()
    keys = [k for k in a if "_extra_state" not in k]
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in keys)
    assert a["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"].dtype == torch.bfloat16
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.num_experts == 8


def test_saved_config_dtype_is_the_bridge_dtype(tmp_path):
    """fp32 checkpoint -> bf16 bridge -> save: config.json says bfloat16 (it said float32 over bf16 tensors; engines
    serve dtype="auto" in the config's dtype, a float32 one in float16, and transformers loaded it in float32)."""
    import json

    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint, save_hf_checkpoint

    src = save_tiny_checkpoint(tmp_path / "fp32", tiny_config(), seed=3)
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
    model = bridge.build_model()
    load_hf_checkpoint(model, src, bridge)
    save_hf_checkpoint(model, tmp_path / "out", bridge)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in _disk(tmp_path / "out").values()} == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").dtype == torch.bfloat16
    assert bridge.hf_config.dtype in (None, torch.float32, "float32")  # the bridge's own config is left alone


def test_missing_checkpoint_dir_is_a_clear_error(tmp_path):
    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.float32)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(bridge.build_model(), tmp_path, bridge)


def test_rollout_expert_codes_equal_trainer_fake_quant_codes():
    """BF16 sync from Megatron: the rollout's stored codes == weight_quantizer() of Megatron's weights."""
    from megatron_trace.bridge import Qwen3MoeBridge, export_hf_weights

    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.bfloat16)
    torch.manual_seed(3)
    trainer = bridge.build_model()
    rollout = HFRolloutBackend(tiny_config(), mode="fp4", dtype=torch.bfloat16)
    sync_weights(rollout, export_hf_weights(trainer, bridge), fmt="bf16")
    wq = TraceConfig().weight_quantizer()
    for L, layer in enumerate(trainer.decoder.layers):
        for e, expert in enumerate(layer.mlp.experts.local_experts):
            for which, w in (("fc1", expert.linear_fc1.weight), ("fc2", expert.linear_fc2.weight)):
                want, got = wq.quantize(w.detach()), rollout.expert_weight_fp4(L, e, which)
                assert torch.equal(got.codes, want.codes), (L, e, which)
                assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
                assert torch.equal(got.global_amax, want.global_amax)
                # and the rollout computes with exactly the trainer's fake-quantized weight
                deq = rollout.model.model.layers[L].mlp.experts
                deq = deq.gate_up_proj[e] if which == "fc1" else deq.down_proj[e]
                assert torch.equal(deq, wq.fake_quantize(w.detach()))


def _rewrite(path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})


def test_a_checkpoint_the_model_does_not_match_is_refused_by_name(tmp_path):
    """Nothing is dropped or cast without a word: tensors no parameter takes (biases, a layer the config lacks),
    quantized tensors, shapes config.json does not give, and index entries that are missing."""
    import json

    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=3)
    disk = _disk(path)

    def load(cfg=None):
        bridge = Qwen3MoeBridge(cfg or AutoConfig.from_pretrained(path), dtype=torch.float32)
        return load_hf_checkpoint(bridge.build_model(), path, bridge)

    fewer = AutoConfig.from_pretrained(path)
    fewer.num_hidden_layers = 2
    with pytest.raises(ValueError, match=r"checkpoint tensor\(s\) map to no parameter of this model, e\.g\. "
                                         r"\['model\.layers\.2\."):
        load(fewer)
    _rewrite(path, {**disk, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(ValueError, match=r"1 checkpoint tensor\(s\) map to no parameter .*q_proj\.bias"):
        load()
    fp8 = {k: v.to(torch.float8_e4m3fn) if "experts" in k else v for k, v in disk.items()}
    _rewrite(path, fp8)
    with pytest.raises(ValueError, match=r"of dtypes \['torch\.float8_e4m3fn'\], .*only bf16 / fp16 / fp32"):
        load()
    quantized = AutoConfig.from_pretrained(path)
    quantized.quantization_config = {"quant_method": "fp8", "fmt": "e4m3"}
    with pytest.raises(NotImplementedError, match="quantization_config=.*'fp8'.*only unquantized"):
        load(quantized)
    wide = dict(disk)
    wide["model.embed_tokens.weight"] = torch.zeros(256, 64)
    _rewrite(path, wide)
    with pytest.raises(ValueError, match=r"\['model\.embed_tokens\.weight'\] -> embedding\.word_embeddings\.weight: "
                                         r"the checkpoint's shape \[\(256, 64\)\] gives \(256, 64\) per rank, the "
                                         r"model's is \(128, 64\)"):
        load()
    _rewrite(path, disk)
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in disk if k != gone}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"1 tensor\(s\) the model needs are not in .*index\.json, e\.g\. "
                                         rf"\['{gone}'\]"):
        load()


def test_tied_embeddings_load_and_an_lm_head_of_its_own_is_refused(tmp_path):
    """tie_word_embeddings=True: the checkpoint has no lm_head (the logits are transformers'); one whose lm_head.weight
    differs from the embedding is refused (transformers unties them: the bridge would silently tie them, logits off by
    the whole output layer)."""
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(tie_word_embeddings=True), seed=3)
    disk = _disk(path)
    assert "lm_head.weight" not in disk

    def load():
        bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=torch.float32)
        model = bridge.build_model().eval()
        load_hf_checkpoint(model, path, bridge)
        return model

    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(tokens).logits
    assert (megatron_logits(load(), tokens) - ref).abs().max() < 1e-4 * ref.abs().max()
    _rewrite(path, {**disk, "lm_head.weight": disk["model.embed_tokens.weight"].clone()})  # the same values: fine
    load()
    near = disk["model.embed_tokens.weight"].clone()
    near[5, 7] = torch.nextafter(near[5, 7], torch.tensor(float("inf")))  # one value, one ulp: differs all the same
    for head in (torch.randn(128, 64, generator=torch.Generator().manual_seed(1)), near):
        _rewrite(path, {**disk, "lm_head.weight": head})
        with pytest.raises(ValueError, match=r"tie_word_embeddings=True but the checkpoint's lm_head\.weight "
                                             r"\(128, 64\) differs from model\.embed_tokens\.weight"):
            load()


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path):
    """Without model.safetensors.index.json every *.safetensors file is read: a tensor in two of them (a stray shard
    of an earlier save) would be taken from whichever file the directory listing gives last."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=3)
    save_file({"model.norm.weight": torch.full((64,), 7.0)}, f"{path}/zz-stray.safetensors", metadata={"format": "pt"})
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) are in more than one safetensors file .*no "
                                         r"model\.safetensors\.index\.json.*'model\.norm\.weight' in "
                                         r"\['model\.safetensors', 'zz-stray\.safetensors'\]"):
        load_hf_checkpoint(bridge.build_model(), path, bridge)


def test_save_writes_transformers_shards_that_load_back_bit_exact(tmp_path):
    """``max_shard_bytes`` splits the checkpoint as transformers does (shards + index); Megatron and transformers load
    it back to exactly what a single-file save gives; a later single-file save into the directory removes the shards
    and the index."""
    import json

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint, save_hf_checkpoint

    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.bfloat16)
    torch.manual_seed(11)
    src = bridge.build_model()
    assert save_hf_checkpoint(src, tmp_path / "one", bridge) == ["model.safetensors"]
    files = save_hf_checkpoint(src, tmp_path / "sharded", bridge, max_shard_bytes=64 << 10)
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    on_disk = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert on_disk == sorted([*files, "config.json", "model.safetensors.index.json"])
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    single = _disk(tmp_path / "one")
    assert index["weight_map"].keys() == single.keys() and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    dst = bridge.build_model()
    load_hf_checkpoint(dst, tmp_path / "sharded", bridge)
    a, b = src.state_dict(), dst.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if "_extra_state" not in k)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "one").eval()(tokens).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()(tokens).logits
    assert torch.equal(got, ref)
    assert save_hf_checkpoint(src, tmp_path / "sharded", bridge) == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="max_shard_bytes=0"):
        save_hf_checkpoint(src, tmp_path / "sharded", bridge, max_shard_bytes=0)
    assert (tmp_path / "sharded" / "model.safetensors").exists()  # refused before anything was removed


def _full_disk_at(monkeypatch, n: int) -> None:
    """safetensors' ``save_file`` raises ENOSPC (a full disk) at its ``n``-th call only, writing as usual otherwise."""
    import errno

    import safetensors.torch

    real_save_file, calls = safetensors.torch.save_file, []

    def full_disk(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) == n:
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)


def test_a_save_that_fails_midway_leaves_the_earlier_checkpoint_and_the_user_s_files(tmp_path, monkeypatch):
    """An I/O error writing shard 3 (safetensors' save_file raising ENOSPC, as on a full disk): the directory keeps
    its earlier checkpoint byte for byte and nothing is left beside it (the save had removed the earlier weights
    first). A later save keeps the user's files (a README, tokenizer files) and drops the earlier checkpoint's shards,
    its index and a ModelOpt export's hf_quant_config.json (engines would read the BF16 weights as NVFP4)."""
    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint, save_hf_checkpoint

    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.bfloat16)
    torch.manual_seed(5)
    old, new = bridge.build_model(), bridge.build_model()
    out = tmp_path / "hf"
    assert len(save_hf_checkpoint(old, out, bridge, max_shard_bytes=64 << 10)) > 3
    for name, text in {"README.md": "my notes", "tokenizer.json": "{}", "hf_quant_config.json": "{}"}.items():
        (out / name).write_text(text)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _full_disk_at(monkeypatch, 3)
    with pytest.raises(OSError, match="No space left on device") as e:
        save_hf_checkpoint(new, out, bridge, max_shard_bytes=64 << 10)
    assert any(f"saving to {out} failed: the directory was left as it was" in n for n in e.value.__notes__)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # the temporary directory is gone
    loaded = bridge.build_model()
    load_hf_checkpoint(loaded, out, bridge)
    a, b = old.state_dict(), loaded.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if "_extra_state" not in k)
    monkeypatch.undo()
    assert save_hf_checkpoint(new, out, bridge) == ["model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "README.md").read_text() == "my notes"
    load_hf_checkpoint(loaded, out, bridge)
    a, b = new.state_dict(), loaded.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if "_extra_state" not in k)


def test_the_export_leaves_the_callers_gradient_mode_alone():
    """The export turns gradients off while it runs, not for its consumer: between tensors, and after a consumer
    that stopped early while keeping the generator (a sync that failed mid-stream; a traceback holds the frame), the
    caller's gradient mode is its own. Before, a failed sync left the trainer's next backward without a graph."""
    from megatron_trace.bridge import Qwen3MoeBridge, export_hf_weights

    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.float32)
    model = bridge.build_model()
    stream = export_hf_weights(model, bridge)
    next(stream)
    assert torch.is_grad_enabled()  # between tensors: the caller's mode
    with torch.no_grad():
        next(stream)
        assert not torch.is_grad_enabled()  # the caller's own mode, kept
    assert torch.is_grad_enabled()
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()  # a training step while the export waits (the stream is kept, not finished)
    assert torch.equal(x.grad, torch.full((2,), 2.0))
    rest = list(stream)
    assert rest and not [n for n, t in rest if t.grad_fn is not None]  # no autograd graph rides along
    # nor a parameter: an fp32 bridge's norms, router and unsplit weights were yielded as the Parameters themselves
    # (requires_grad: a consumer's ``numpy()`` raised, its arithmetic built graphs on the model)
    assert not [n for n, t in rest if t.requires_grad or isinstance(t, torch.nn.Parameter)]


def test_a_value_that_overflows_float16_is_refused_naming_the_tensor(tmp_path):
    """An fp32 checkpoint loaded into a float16 bridge: a value past 65504 became Inf in the parameter, silently."""
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=3)
    disk = _disk(path)
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    big = disk[name].float().clone()
    big[0, 0] = 1e5
    big[0, 1] = float("inf")  # already Inf in the checkpoint: not an overflow of the cast, not counted
    _rewrite(path, {**disk, name: big})
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=torch.float16)
    with pytest.raises(ValueError, match=rf"{name}: 1 value\(s\) \(\|x\| up to 100000\) overflow .*float16"):
        load_hf_checkpoint(bridge.build_model(), path, bridge)
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)  # fits bf16
    model = bridge.build_model()
    load_hf_checkpoint(model, path, bridge)
    assert sum(int(p.isinf().sum()) for p in model.parameters()) == 1  # the checkpoint's own Inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_checkpoint_of_any_float_dtype_loads_its_values(tmp_path, dtype):
    """fp16 (older releases), bf16 and fp64 checkpoints load, each value cast to the bridge's dtype (the fixtures are
    all fp32: a bridge that refused fp16 or fp64 headers as unmapped passed every other test)."""
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=3)
    disk = {k: v.to(dtype) for k, v in _disk(path).items()}
    _rewrite(path, disk)
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model = bridge.build_model()
    stats = load_hf_checkpoint(model, path, bridge)
    assert stats.bytes == sum(t.numel() for t in disk.values()) * torch.finfo(dtype).bits // 8
    expert = model.decoder.layers[1].mlp.experts.local_experts[6].linear_fc2.weight
    assert torch.equal(expert, disk["model.layers.1.mlp.experts.6.down_proj.weight"].float())
    assert torch.equal(model.embedding.word_embeddings.weight, disk["model.embed_tokens.weight"].float())


def test_an_index_entry_whose_file_lacks_the_tensor_is_refused_by_name(tmp_path):
    """model.safetensors.index.json names a file that does not hold the tensor (a shard replaced by another save)."""
    import json

    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=3)
    disk = _disk(path)
    gone = "model.layers.2.self_attn.k_norm.weight"
    _rewrite(path, {k: v for k, v in disk.items() if k != gone})
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in disk}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"1 tensor\(s\) the model needs are in no safetensors file of .*"
                                         rf"\['{gone}'\]"):
        load_hf_checkpoint(bridge.build_model(), path, bridge)


def test_a_config_with_fewer_experts_than_the_checkpoint_is_refused_by_name(tmp_path):
    """The checkpoint's experts 4..7 map to no parameter of a 4-expert model: refused naming them (before the
    router's [8, H] shape is), not left to another rank as under EP."""
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=3)
    fewer = AutoConfig.from_pretrained(path)
    fewer.num_experts = 4
    bridge = Qwen3MoeBridge(fewer, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"36 checkpoint tensor\(s\) map to no parameter of this model, e\.g\. "
                                         r"\['model\.layers\.0\.mlp\.experts\.4\."):
        load_hf_checkpoint(bridge.build_model(), path, bridge)


@pytest.mark.parametrize("override, field, hf_field", [
    (dict(num_experts_per_tok=3), "moe_router_topk=3 (saved: 2)", "num_experts_per_tok"),
    (dict(norm_topk_prob=False), "moe_router_pre_softmax=True (saved: False)", "norm_topk_prob"),
    (dict(rms_norm_eps=1e-5), "layernorm_epsilon=1e-05 (saved: 1e-06)", "rms_norm_eps"),
    (dict(rope_theta=1e6), "rotary_base=1000000.0 (saved: 10000.0)", "rope"),
], ids=["top_k", "norm_topk_prob", "rms_norm_eps", "rope_theta"])
def test_a_config_that_computes_another_model_than_the_checkpoint_is_refused_by_name(tmp_path, override, field,
                                                                                      hf_field):
    """Fields no tensor has a shape for (top-k, router normalisation, norm epsilon, RoPE theta): a config differing
    from the checkpoint's config.json (which the rollout engines read) in one of them loaded silently (slime#1059),
    and the trainer computed another model than the one the rollout served. Nothing is loaded."""
    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=3)
    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.float32)
    load_hf_checkpoint(bridge.build_model(), path, bridge)  # the config it was saved with
    other = Qwen3MoeBridge(tiny_config(**override), dtype=torch.float32)
    model = other.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
    with pytest.raises(ValueError, match=rf"computes another model than the one saved there: {re.escape(field)} \(HF "
                                         rf"config fields that differ: \[.*'{hf_field}"):
        load_hf_checkpoint(model, path, other)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_router_expert_bias_is_not_dropped_from_the_export():
    """Megatron keeps the router's expert_bias (aux-loss-free balancing, a config override) as a buffer, outside
    named_parameters; Qwen3-MoE has no HF tensor for it, so the export of a model built with one (from a config of
    its own) refuses it by name instead of leaving the rollout to route without it."""
    import dataclasses

    from megatron_trace.bridge import Qwen3MoeBridge, export_hf_weights
    from megatron_trace.bridge.config import build_gpt_model

    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.float32)  # (the bridge refuses the override itself: above)
    biased = dataclasses.replace(bridge.config, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    with pytest.raises(NotImplementedError, match=r"decoder\.layers\.0\.mlp\.router\.expert_bias"):
        list(export_hf_weights(build_gpt_model(tiny_config(), biased), bridge))


def test_a_write_that_fails_once_in_a_drained_save_still_raises_at_the_end(tmp_path, monkeypatch):
    """Under torch.distributed rank 0 keeps draining the export after a write failed (its peers wait in the gathers);
    the error must still be raised at the end even when the disk recovers (a transient ENOSPC): else the writer
    closes and the save commits a checkpoint without the tensors from the failed shard on."""
    from megatron_trace.bridge.checkpoint import _write_all
    from megatron_trace.rollout.hf_weights import ShardedSafetensorsWriter

    _full_disk_at(monkeypatch, 1)
    weights = [(f"w{i}", torch.full((256,), float(i))) for i in range(4)]  # 1 KiB each: one per shard
    drained = []
    with pytest.raises(OSError, match="No space left on device"):
        with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1024) as writer:
            _write_all(writer, (drained.append(n) or (n, t) for n, t in weights), drain=True)
    assert drained == ["w0", "w1", "w2", "w3"]  # drained to the end
    assert list(tmp_path.iterdir()) == []  # and nothing left


@pytest.mark.parametrize("kw,match", [
    (dict(dtype="bf16"), r"dtype='bf16' must be one of \(torch.bfloat16, torch.float16, torch.float32\)"),
    (dict(dtype=torch.int8), r"dtype=torch.int8 must be one of"),
    (dict(tensor_parallel=0), r"tensor_parallel=0 must be an int >= 1"),
    (dict(expert_parallel=True), r"expert_parallel=True must be an int >= 1"),
    (dict(load_balancing="bogus"), r"load_balancing='bogus' must be one of \('none', 'aux_loss'"),
])
def test_transformer_config_build_settings_are_checked_by_name(kw, match):
    """"bf16" and torch.int8 were taken as params_dtype, tensor_parallel=0 was a ZeroDivisionError, True an
    expert_parallel of 1, and an unknown load balancing balanced nothing under the HF config's aux-loss coefficient."""
    with pytest.raises(ValueError, match=match):
        transformer_config_from_hf(tiny_config(), **kw)
