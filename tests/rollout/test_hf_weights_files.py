"""``ShardedSafetensorsWriter``: transformers' shard names and index, bounded host memory, partial files."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_trace.rollout.hf_weights import INDEX_FILE, ShardedSafetensorsWriter


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(8, 16, generator=g) for i in range(10)} | {"big": torch.randn(64, 64, generator=g)}


def test_shards_fill_in_order_and_hold_one_shard_plus_one_tensor(tmp_path):
    tensors = _tensors()  # 512 bytes each, "big" 16 KiB: above the shard size, a shard of its own
    with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1500) as w:
        for name, t in tensors.items():
            w.add(name, t)
    assert w.files == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*w.files, INDEX_FILE])
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["weight_map"]["t0"] == w.files[0] and index["weight_map"]["big"] == w.files[-1]
    back = {}
    for f in w.files:
        shard = load_file(tmp_path / f)
        assert set(shard) == {n for n, v in index["weight_map"].items() if v == f}
        back.update(shard)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert w.peak_bytes == 1024 + 64 * 64 * 4  # two small ones held when the big one came, never the whole set


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    view = torch.arange(12.0).view(3, 4)
    with ShardedSafetensorsWriter(tmp_path) as w:
        w.add("a", view[:, :2])  # a non-contiguous view and another of the same storage
        w.add("b", view[1])
    assert w.files == ["model.safetensors"] and sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    back = load_file(tmp_path / "model.safetensors")
    assert torch.equal(back["a"], view[:, :2]) and torch.equal(back["b"], view[1])


def test_refusals_and_an_interrupted_write_leaves_no_partial_files(tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_bytes"):
            ShardedSafetensorsWriter(tmp_path, max_shard_bytes=bad)
    with pytest.raises(RuntimeError, match="export failed"):
        with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=600) as w:
            for name, t in _tensors().items():
                w.add(name, t)
                if name == "t5":
                    with pytest.raises(ValueError, match="'t5' was already written"):
                        w.add("t5", t)
                    raise RuntimeError("export failed")
    assert list(tmp_path.iterdir()) == []
