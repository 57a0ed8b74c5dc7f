"""The demo's ``init_from``: a checkpoint of another model than the run's ``model.*`` is refused before any work."""

import json
from pathlib import Path

import pytest

from megatron_trace.config import TraceConfig
from megatron_trace.rl.demo import check_init_from, run
from megatron_trace.rl.driver import RLConfig
from megatron_trace.rl.sft import SFTConfig, TinyMoEConfig
from megatron_trace.rl.tasks import CharTokenizer

MODEL = TinyMoEConfig(num_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      num_experts=4, top_k=2, moe_intermediate_size=32)


def _checkpoint_dir(path: Path, model: TinyMoEConfig) -> str:
    """A config.json as the demo's SFT warm-up writes it for ``model`` (the weights are not read by the check)."""
    path.mkdir()
    hf = model.hf_config(CharTokenizer().vocab_size, CharTokenizer())
    (path / "config.json").write_text(hf.to_json_string())
    return str(path)


def test_init_from_of_another_model_is_refused_naming_each_field(tmp_path):
    """The run trains the checkpoint's model, but checked the arms' layer policies against ``model.*`` and recorded
    ``model.*`` in run.json: an 8-layer checkpoint (the GPU config's warm-up) ran in a 4-layer CPU config's record."""
    bigger = TinyMoEConfig(**{**MODEL.__dict__, "num_layers": 8, "top_k": 3})
    other = _checkpoint_dir(tmp_path / "other", bigger)
    with pytest.raises(ValueError, match=r"is another model than the run's: model.num_layers=2 but "
                                         r"num_hidden_layers=8, model.top_k=2 but num_experts_per_tok=3; .*"
                                         r"\(model.num_layers=8 model.top_k=3\)"):
        check_init_from(other, MODEL)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="is another model than the run's"):
        run(out_dir=out, task_name="add", arms=["bf16"], trace=TraceConfig(), rl=RLConfig(steps=1), model=MODEL,
            sft=SFTConfig(steps=5), init_from=other, progress=False)
    assert not out.exists()  # before any work
    check_init_from(other, bigger)  # the checkpoint's own model passes
    check_init_from(_checkpoint_dir(tmp_path / "same", MODEL), MODEL)


def test_init_from_keys_left_out_take_the_defaults_the_run_loads_them_with(tmp_path):
    """A config.json may leave keys out (num_key_value_heads): the run's model has the value transformers loads."""
    from transformers import AutoConfig

    path = Path(_checkpoint_dir(tmp_path / "ck", MODEL))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(cfg))
    loaded = AutoConfig.from_pretrained(str(path)).num_key_value_heads
    assert loaded != MODEL.num_key_value_heads
    with pytest.raises(ValueError, match=rf"model.num_key_value_heads=1 but num_key_value_heads={loaded}; "):
        check_init_from(path, MODEL)
