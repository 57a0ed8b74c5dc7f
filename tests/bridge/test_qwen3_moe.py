"""Megatron GPTModel <-> HF Qwen3-MoE (world size 1; EP=2 in test_expert_parallel.py)."""

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


def test_a_non_default_rope_theta_gives_transformers_logits(tmp_path):
    """Qwen3-MoE releases use rope_theta=1e6; the tiny config's 1e4 is also Megatron's default, so a bridge that
    dropped the checkpoint's theta passed every other test while rotating every query and key by other angles."""
    from megatron_trace.bridge import load_hf_checkpoint
    from megatron_trace.bridge.config import gpt_model_kwargs, rope_theta

    cfg = tiny_config(rope_theta=1e6)
    assert rope_theta(cfg) == 1e6 and gpt_model_kwargs(cfg)["rotary_base"] == 1e6
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
    _rewrite(path, {**disk, "lm_head.weight": torch.randn(128, 64, generator=torch.Generator().manual_seed(1))})
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True but the checkpoint's lm_head\.weight \(128, 64\) "
                                         r"differs from model\.embed_tokens\.weight"):
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


def test_a_save_that_fails_midway_leaves_the_earlier_checkpoint_and_the_user_s_files(tmp_path, monkeypatch):
    """An I/O error writing shard 3 (safetensors' save_file raising ENOSPC, as on a full disk): the directory keeps
    its earlier checkpoint byte for byte and nothing is left beside it (the save had removed the earlier weights
    first). A later save keeps the user's files (a README, tokenizer files) and drops the earlier checkpoint's shards,
    its index and a ModelOpt export's hf_quant_config.json (engines would read the BF16 weights as NVFP4)."""
    import errno

    import safetensors.torch

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint, save_hf_checkpoint

    bridge = Qwen3MoeBridge(tiny_config(), dtype=torch.bfloat16)
    torch.manual_seed(5)
    old, new = bridge.build_model(), bridge.build_model()
    out = tmp_path / "hf"
    assert len(save_hf_checkpoint(old, out, bridge, max_shard_bytes=64 << 10)) > 3
    for name, text in {"README.md": "my notes", "tokenizer.json": "{}", "hf_quant_config.json": "{}"}.items():
        (out / name).write_text(text)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_save_file, shards = safetensors.torch.save_file, []

    def full_disk(tensors, filename, *args, **kwargs):
        shards.append(filename)
        if len(shards) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
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
    assert len(list(stream)) > 0


def test_a_value_that_overflows_float16_is_refused_naming_the_tensor(tmp_path):
    """An fp32 checkpoint loaded into a float16 bridge: a value past 65504 became Inf in the parameter, silently."""
    from transformers import AutoConfig

    from megatron_trace.bridge import Qwen3MoeBridge, load_hf_checkpoint

    path = save_tiny_checkpoint(tmp_path / "hf", tiny_config(), seed=3)
    disk = _disk(path)
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    big = disk[name].float().clone()
    big[0, 0] = 1e5
    _rewrite(path, {**disk, name: big})
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=torch.float16)
    with pytest.raises(ValueError, match=rf"{name}: 1 value\(s\) \(\|x\| up to 100000\) overflow .*float16"):
        load_hf_checkpoint(bridge.build_model(), path, bridge)
    bridge = Qwen3MoeBridge(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)  # fits bf16
    model = bridge.build_model()
    load_hf_checkpoint(model, path, bridge)
    assert all(p.isfinite().all() for p in model.parameters())
