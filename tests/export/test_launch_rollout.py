"""``examples/sglang/launch_rollout.py export``: the files beside the weights travel with the exported checkpoint."""

import importlib.util
import json
import pathlib

from safetensors.torch import save_file

from ._tiny import tiny_hf_config, tiny_named_weights

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "sglang" / "launch_rollout.py"


def _example():
    spec = importlib.util.spec_from_file_location("launch_rollout", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_copies_every_side_file_and_keeps_its_own_configs(tmp_path):
    """The chat template (transformers' ``chat_template.jinja``) was left behind: only .json/.txt/.model files were
    copied, so the served checkpoint had no chat template. A source's quant config would overwrite the export's."""
    src, out = tmp_path / "hf", tmp_path / "ckpt"
    src.mkdir()
    save_file(dict(tiny_named_weights()), src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(tiny_hf_config()))
    side = {"chat_template.jinja": "{{ messages }}", "tokenizer.json": "{}", "tokenizer_config.json": "{}",
            "generation_config.json": '{"top_p": 0.9}', "merges.txt": "a b", "README.md": "notes"}
    for name, text in side.items():
        (src / name).write_text(text)
    (src / "hf_quant_config.json").write_text('{"stale": true}')
    (src / "pytorch_model.bin").write_bytes(b"not copied")
    (src / "sub").mkdir()  # (a directory is not a file to copy)
    _example().export(str(src), str(out), input_amax=4.0)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*side, "config.json", "hf_quant_config.json", "model.safetensors"])
    assert {name: (out / name).read_text() for name in side} == side
    quant = json.loads((out / "hf_quant_config.json").read_text())
    assert quant["quantization"]["quant_algo"] == "NVFP4" and "stale" not in quant
