"""The demo's SFT warm-up (``rl.sft``) against computations written out here: its seeded init and batch, its first
loss, its first AdamW step, and what its settings accept."""

import math

import pytest
import torch

from megatron_trace.rl.sft import SFTConfig, TinyMoEConfig, sft_checkpoint, sft_reusable
from megatron_trace.rl.tasks import CharTokenizer, get_task, sft_batch

MODEL = TinyMoEConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      num_experts=4, top_k=2, moe_intermediate_size=16)


def _init(seed: int):
    """The warm-up's model before its first step: built after ``torch.manual_seed(seed)``."""
    from transformers import Qwen3MoeForCausalLM

    tok = CharTokenizer()
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(MODEL.hf_config(tok.vocab_size, tok)).float()


def test_the_first_warm_up_loss_is_the_cross_entropy_of_the_answers_of_its_seeded_batch(tmp_path):
    """Step 0's loss: the mean next-token cross-entropy over the answer and EOS positions of ``sft_batch`` drawn from
    a generator of ``sft.seed`` (at ``label_noise``), under the init of ``sft.seed``; progress sees steps 0, 1, ..."""
    task, tok, sft = get_task("add"), CharTokenizer(), SFTConfig(steps=2, batch_size=8, seed=3, label_noise=0.5)
    seen = []
    sft_checkpoint(tmp_path, task, MODEL, sft, progress=lambda s, loss: seen.append((s, loss)))
    assert [s for s, _ in seen] == [0, 1]
    ids, mask = sft_batch(task, tok, 8, torch.Generator().manual_seed(3), 0.5)
    with torch.no_grad():
        logp = torch.log_softmax(_init(3)(input_ids=ids).logits.double(), -1)
    nll = [-float(logp[b, t - 1, ids[b, t]]) for b in range(8) for t in range(1, ids.shape[1]) if mask[b, t]]
    assert len(nll) == 8 * (task.answer_len + 1)
    assert seen[0][1] == pytest.approx(sum(nll) / len(nll), rel=1e-5)


def test_the_first_warm_up_step_moves_each_weight_by_lr_over_50(tmp_path):
    """AdamW's first step moves a weight by lr * g / (|g| + eps): the warm-up's lr ramps up over 50 steps, so at most
    lr / 50 (reached where |g| >> eps), with no weight decay: the embedding of a token no batch holds ('>' in
    addition) keeps its seeded init exactly."""
    from transformers import Qwen3MoeForCausalLM

    sft = SFTConfig(steps=1, batch_size=4, seed=1, lr=1e-2)
    out = sft_checkpoint(tmp_path, get_task("add"), MODEL, sft)
    got = Qwen3MoeForCausalLM.from_pretrained(out).float().state_dict()
    init = _init(1).state_dict()
    assert got.keys() == init.keys()
    moved = max(float((got[k] - init[k]).abs().max()) for k in got)
    assert moved == pytest.approx(sft.lr / 50, rel=1e-3)
    row = CharTokenizer().stoi[">"]
    assert torch.equal(got["model.embed_tokens.weight"][row], init["model.embed_tokens.weight"][row])


def test_a_warm_up_without_its_config_json_is_trained_again(tmp_path):
    task, sft = get_task("add"), SFTConfig(steps=1, batch_size=2)
    sft_checkpoint(tmp_path, task, MODEL, sft)
    (tmp_path / "config.json").unlink()  # the weights' directory lost its config: no checkpoint to start from
    assert not sft_reusable(tmp_path, task, MODEL, sft)
    sft_checkpoint(tmp_path, task, MODEL, sft)
    assert (tmp_path / "config.json").exists() and sft_reusable(tmp_path, task, MODEL, sft)


def test_the_demo_model_is_the_qwen3_moe_of_its_settings():
    """top_k experts per token with normalised weights (Qwen3-MoE's releases), an output layer of its own; every
    accepted setting is one the Megatron bridge maps (top_k = num_experts included)."""
    from megatron_trace.bridge.config import check_supported

    tok = CharTokenizer()
    for model in (MODEL, TinyMoEConfig(num_experts=2, top_k=2), TinyMoEConfig(top_k=3)):
        hf = model.hf_config(tok.vocab_size, tok)
        check_supported(hf)
        assert (hf.num_experts_per_tok, hf.num_experts, hf.norm_topk_prob, hf.tie_word_embeddings) == (
            model.top_k, model.num_experts, True, False)


@pytest.mark.parametrize("cls,kw,match", [
    # were accepted: a YAML true as 1; an infinite lr (the warm-up saved NaN weights); top_k=1, which the bridge
    # refuses with normalised top-k weights (after the whole warm-up); a negative label_noise
    (TinyMoEConfig, dict(num_layers=True), "TinyMoEConfig.num_layers=True must be an int >= 1"),
    (TinyMoEConfig, dict(top_k=1), r"TinyMoEConfig.top_k=1 must be >= 2"),
    (SFTConfig, dict(steps=True), "SFTConfig.steps=True must be an int >= 1"),
    (SFTConfig, dict(lr=math.inf), "SFTConfig.lr=inf must be > 0 \\(a finite number\\)"),
    (SFTConfig, dict(lr=math.nan), "SFTConfig.lr=nan must be > 0 \\(a finite number\\)"),
    (SFTConfig, dict(lr=True), "SFTConfig.lr=True must be > 0 \\(a finite number\\)"),
    (SFTConfig, dict(lr="3e-3"), "SFTConfig.lr='3e-3' must be > 0 \\(a finite number\\)"),
    (SFTConfig, dict(label_noise=-0.1), r"SFTConfig.label_noise=-0.1 must be in \[0, 1\]"),
    (SFTConfig, dict(label_noise=True), r"SFTConfig.label_noise=True must be in \[0, 1\]"),
    (SFTConfig, dict(label_noise=math.nan), r"SFTConfig.label_noise=nan must be in \[0, 1\]"),
])
def test_bad_warm_up_settings_are_named(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def test_edge_warm_up_settings_are_accepted():
    SFTConfig(label_noise=0.0), SFTConfig(label_noise=1), SFTConfig(seed=0, lr=1)
    TinyMoEConfig(num_experts=2, top_k=2)


@pytest.mark.parametrize("bad,error,match", [
    (dict(task="add"), TypeError, r"task must be a Task \(get_task\(name\) for a task\), got str 'add'"),
    (dict(model_cfg={"num_layers": 1}), TypeError, r"model_cfg must be a TinyMoEConfig, got dict"),
    (dict(sft=None), TypeError, r"sft must be a SFTConfig, got NoneType"),
    (dict(progress="tqdm"), TypeError, r"progress='tqdm' must be None or a callable\(step, loss\)"),
    (dict(out_dir="file"), NotADirectoryError, r"out_dir=.* is a file: give the checkpoint's directory"),
])
def test_sft_checkpoint_refuses_bad_arguments_before_training(tmp_path, bad, error, match):
    """A task name or a dict failed with an AttributeError / TypeError; an out_dir that is a file was refused by mkdir
    and a progress that is no callable at the first step, both after training had begun."""
    (tmp_path / "file").write_text("x")
    args = dict(out_dir=tmp_path / "ckpt", task=get_task("add"), model_cfg=TinyMoEConfig(num_layers=1),
                sft=SFTConfig(steps=1, batch_size=2), progress=None) | bad
    if bad.get("out_dir"):
        args["out_dir"] = tmp_path / bad["out_dir"]
    with pytest.raises(error, match=match):
        sft_checkpoint(**args)
    assert not (tmp_path / "ckpt").exists()
